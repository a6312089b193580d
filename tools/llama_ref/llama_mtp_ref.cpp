// llama_mtp_ref: llama.cpp's MTP ("nextn") draft head on token sequences, for Deimos's tests
// (tests/test_mtp.py through tools/make_qwen35_reference.py).
//
//   llama_mtp_ref MODEL INPUT N_DRAFT TOPK > out.json
//
// INPUT: one token sequence per line, decimal ids separated by spaces. For each sequence
// x_0 .. x_{N-1}, as common/speculative.cpp's draft-mtp driver does it (build 11434):
//   1. the target context (LLAMA_CONTEXT_TYPE_DEFAULT) decodes the sequence in one batch with
//      every position's output and llama_set_embeddings_nextn(ctx, true, masked=false): its
//      logits (top-k) and h_i, the hidden state after output_norm (t_h_nextn), every position;
//   2. an MTP context (LLAMA_CONTEXT_TYPE_MTP on the same model, loaded with load_mtp) decodes
//      the rows (x_k, h_{k-1}) at positions k (h_{-1} = 0, the driver's first pending row),
//      every row output: the MTP logits (top-k) of each row;
//   3. drafting: the main model's greedy token x_N (argmax at N - 1) with h_{N-1} at position N,
//      then each drafted token (greedy: argmax of the MTP logits) with the MTP context's own
//      h' (its t_h_nextn) at the next position, N_DRAFT steps: tokens, top-k, h'.
// Settings as llama_ref.c: n_ctx 512 (a sequence is one batch), 1 thread, f32 K/V cache, flash
// attention off, CPU. Floats printed with %.9g (round-trips float32).
//
// C++ because the nextn embeddings are read through llama.cpp's staging header
// src/llama-ext.h (C++ linkage).

#include "llama.h"
#include "llama-ext.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static const int N_CTX = 512;

static void quiet_log(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static bool no_progress(float, void *) {
    return true;
}

[[noreturn]] static void die(const char * msg, const char * detail = nullptr) {
    fprintf(stderr, "llama_mtp_ref: %s%s%s\n", msg, detail ? ": " : "", detail ? detail : "");
    exit(1);
}

// [[id, logit], ...] of the k largest logits, largest first (ties: lower id first); the argmax.
static int put_topk(const float * logits, int n_vocab, int k) {
    std::vector<int> top;
    for (int id = 0; id < n_vocab; id++) {
        if ((int) top.size() < k || logits[id] > logits[top.back()]) {
            if ((int) top.size() == k) top.pop_back();
            size_t j = top.size();
            top.push_back(id);
            while (j > 0 && logits[id] > logits[top[j - 1]]) {
                top[j] = top[j - 1];
                j--;
            }
            top[j] = id;
        }
    }
    putchar('[');
    for (size_t i = 0; i < top.size(); i++) {
        printf("%s[%d,%.9g]", i ? "," : "", top[i], logits[top[i]]);
    }
    putchar(']');
    return top[0];
}

static void put_row(const float * x, int n) {
    putchar('[');
    for (int i = 0; i < n; i++) printf("%s%.9g", i ? "," : "", x[i]);
    putchar(']');
}

static void process_or_die(llama_context * ctx, llama_batch_ext * batch, const char * what) {
    int rc = llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch);
    if (rc != 0) die("llama_process failed", what);
}

// Adds row (token, pos, h) with its output to the MTP batch.
static void add_row(llama_batch_ext * b, llama_token tok, llama_pos pos, const float * h, int n_embd) {
    int idx = llama_batch_ext_add_token(b, 0, tok);
    if (idx < 0) die("llama_batch_ext_add_token failed");
    if (!llama_batch_ext_set_pos(b, idx, &pos)) die("llama_batch_ext_set_pos failed");
    llama_embd e = {h, 1, (size_t) n_embd};
    if (!llama_batch_ext_set_embd_token(b, idx, e)) die("llama_batch_ext_set_embd_token failed");
    if (!llama_batch_ext_set_output_logits(b, idx, true)) die("llama_batch_ext_set_output_logits failed");
}

static void run(llama_context * tgt, llama_context * mtp, const std::vector<llama_token> & x,
                int n_vocab, int n_embd, int n_draft, int topk) {
    const int n = (int) x.size();
    if (n + n_draft + 1 > N_CTX) die("sequence + drafts exceed n_ctx");

    // 1. the target model, every position
    llama_memory_clear(llama_get_memory(tgt), true);
    llama_batch batch = llama_batch_init(N_CTX, 0, 1);
    batch.n_tokens = n;
    for (int i = 0; i < n; i++) {
        batch.token[i] = x[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    if (llama_decode(tgt, batch) != 0) die("llama_decode (target) failed");
    std::vector<float> h((size_t) n * n_embd);
    printf("{\"tokens\":[");
    for (int i = 0; i < n; i++) printf("%s%d", i ? "," : "", x[i]);
    printf("],\"main_top\":[");
    int x_next = 0;
    for (int i = 0; i < n; i++) {
        if (i) putchar(',');
        x_next = put_topk(llama_get_logits_ith(tgt, i), n_vocab, topk);
        memcpy(&h[(size_t) i * n_embd], llama_get_embeddings_nextn_ith(tgt, i), sizeof(float) * n_embd);
    }
    printf("],\"h\":[");
    for (int i = 0; i < n; i++) {
        if (i) putchar(',');
        put_row(&h[(size_t) i * n_embd], n_embd);
    }
    llama_batch_free(batch);

    // 2. the MTP catch-up over the same positions: (x_k, h_{k-1})
    llama_memory_clear(llama_get_memory(mtp), true);
    std::vector<float> zeros(n_embd, 0.0f);
    llama_batch_ext * b = llama_batch_ext_init(mtp);
    for (int k = 0; k < n; k++) {
        add_row(b, x[k], k, k == 0 ? zeros.data() : &h[(size_t) (k - 1) * n_embd], n_embd);
    }
    process_or_die(mtp, b, "MTP catch-up");
    printf("],\"mtp_top\":[");
    for (int k = 0; k < n; k++) {
        if (k) putchar(',');
        put_topk(llama_get_logits_ith(mtp, k), n_vocab, topk);
    }

    // 3. greedy drafts from the main model's next token
    printf("],\"draft\":{\"first\":%d,\"top\":[", x_next);
    std::vector<llama_token> drafted;
    std::vector<float> hh(&h[(size_t) (n - 1) * n_embd], &h[(size_t) n * n_embd]);
    llama_token tok = x_next;
    for (int s = 0; s < n_draft; s++) {
        llama_batch_ext_clear(b);
        add_row(b, tok, n + s, hh.data(), n_embd);
        process_or_die(mtp, b, "MTP draft");
        if (s) putchar(',');
        tok = put_topk(llama_get_logits_ith(mtp, 0), n_vocab, topk);
        drafted.push_back(tok);
        memcpy(hh.data(), llama_get_embeddings_nextn_ith(mtp, 0), sizeof(float) * n_embd);
    }
    printf("],\"tokens\":[");
    for (size_t i = 0; i < drafted.size(); i++) printf("%s%d", i ? "," : "", drafted[i]);
    printf("],\"last_h\":");
    put_row(hh.data(), n_embd);
    printf("}}");
    llama_batch_ext_free(b);
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL INPUT N_DRAFT TOPK\n", argv[0]);
        return 2;
    }
    const int n_draft = atoi(argv[3]), topk = atoi(argv[4]);
    if (n_draft < 1 || n_draft > 64) die("N_DRAFT must be in 1..64", argv[3]);
    if (topk < 1 || topk > 64) die("TOPK must be in 1..64", argv[4]);
    FILE * in = fopen(argv[2], "r");
    if (!in) die("cannot open input", argv[2]);

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.load_mtp = true;
    mp.progress_callback = no_progress;  // no loading dots on stderr
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) die("cannot load model", argv[1]);
    if (llama_model_n_layer_nextn(model) < 1) die("the model has no MTP layers", argv[1]);
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab), n_embd = llama_model_n_embd(model);

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = N_CTX;
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = 1;
    cp.type_k = cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.no_perf = true;
    llama_context * tgt = llama_init_from_model(model, cp);
    if (!tgt) die("cannot create the target context");
    llama_set_embeddings_nextn(tgt, true, false);
    cp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    llama_context * mtp = llama_init_from_model(model, cp);
    if (!mtp) die("cannot create the MTP context");
    llama_set_embeddings_nextn(mtp, true, true);

    printf("{\"n_vocab\":%d,\"n_embd\":%d,\"n_layer_nextn\":%d,\"results\":[", n_vocab, n_embd,
           llama_model_n_layer_nextn(model));
    char buf[1 << 16];
    bool first = true;
    while (fgets(buf, sizeof buf, in)) {
        std::vector<llama_token> x;
        for (char * t = strtok(buf, " \n"); t; t = strtok(nullptr, " \n")) {
            char * end;
            long id = strtol(t, &end, 10);
            if (*end || id < 0 || id >= n_vocab) die("bad token id", t);
            x.push_back((llama_token) id);
        }
        if (x.empty()) die("empty token sequence");
        if (!first) putchar(',');
        first = false;
        run(tgt, mtp, x, n_vocab, n_embd, n_draft, topk);
        putchar('\n');
        fflush(stdout);
    }
    printf("]}\n");
    fclose(in);
    llama_free(mtp);
    llama_free(tgt);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
