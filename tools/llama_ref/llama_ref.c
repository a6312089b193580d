// llama_ref: reference logits and greedy tokens from llama.cpp, for Deimos's tests.
//
//   llama_ref MODEL greedy INPUT N_PREDICT TOPK [OPTIONS]  > out.json
//   llama_ref MODEL forced INPUT 0 TOPK [OPTIONS]          > out.json
//   llama_ref MODEL logits INPUT 0 0 --out LOGITS.f32 [OPTIONS] > header.json
//
// logits: teacher-forced like forced, but the FULL logits of every scored position go to
// LOGITS.f32 as raw native float32 (n_vocab per position, sequence after sequence); stdout
// is the JSON header: per sequence its tokens, the scored positions and the byte offset of
// its first row. The exactness study (tools/exactness) reads them.
//
// OPTIONS (defaults: the fixed settings below):
//   --ctx N        context size (and batch size: a sequence is one llama_decode) [512]
//   --ngl N        layers offloaded to the GPU (99: all; needs a CUDA build of libllama) [0]
//   --kv f32|f16   K and V cache type [f32]
//   --fa on|off|auto  flash attention [off]
//   --threads N    [1]
//   --stride S, --from F  (logits) score positions F, F+S, ... and always the last [0, 1]
//   --out PATH     (logits) where the float32 rows go
// INPUT is line based so that this program needs no JSON parser (the Python
// driver tools/llama_ref/run.py converts from and to JSON):
//   greedy: one prompt per line, its raw UTF-8 bytes as lower-case hex
//           (an empty line is an empty prompt);
//   forced: one token sequence per line, decimal ids separated by spaces.
//
// Output is JSON holding only numbers, booleans and hex strings, so it is valid
// whatever bytes the model produces (a token may end inside a UTF-8 character).
//
// Default settings, so that runs are reproducible and comparable with Deimos:
//   n_ctx 512, 1 thread, fp32 K and V cache, flash attention off, CPU only,
//   tokenize with add_special=true (BOS/EOS as the model's metadata says) and
//   parse_special=false (special-token text in a prompt stays plain text);
//   greedy = argmax over the raw logits (lowest id wins a tie), no sampler chain.
// Logits are printed with %.9g, which round-trips a float32 exactly.

#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LINE (1 << 20)

struct options {
    int n_ctx, n_gpu_layers, n_threads, stride, from;
    enum ggml_type kv_type;
    enum llama_flash_attn_type fa;
    const char * out;
};

static int N_CTX = 512;  // --ctx; set once in main before any sequence runs

static void quiet_log(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level >= GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static void die(const char * msg, const char * detail) {
    fprintf(stderr, "llama_ref: %s%s%s\n", msg, detail ? ": " : "", detail ? detail : "");
    exit(1);
}

static void put_hex(const unsigned char * p, size_t n) {
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        printf("%02x", p[i]);
    }
    putchar('"');
}

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

// Decodes hex in place; returns the byte count.
static size_t unhex(char * s) {
    size_t n = strlen(s);
    if (n % 2) die("odd-length hex line", s);
    for (size_t i = 0; i < n / 2; i++) {
        int hi = hexval(s[2 * i]), lo = hexval(s[2 * i + 1]);
        if (hi < 0 || lo < 0) die("bad hex digit in line", s);
        s[i] = (char) (hi * 16 + lo);
    }
    return n / 2;
}

// Prints [[id, logit], ...] of the k largest logits, largest first (ties: lower id first).
// Returns the argmax.
static int put_topk(const float * logits, int n_vocab, int k) {
    int top[64];
    int n = 0;
    for (int id = 0; id < n_vocab; id++) {
        if (n < k || logits[id] > logits[top[n - 1]]) {
            int j = n < k ? n++ : n - 1;
            while (j > 0 && logits[id] > logits[top[j - 1]]) {
                top[j] = top[j - 1];
                j--;
            }
            top[j] = id;
        }
    }
    putchar('[');
    for (int i = 0; i < n; i++) {
        printf("%s[%d,%.9g]", i ? "," : "", top[i], logits[top[i]]);
    }
    putchar(']');
    return top[0];
}

static void decode_or_die(struct llama_context * ctx, struct llama_batch batch) {
    int rc = llama_decode(ctx, batch);
    if (rc != 0) {
        char buf[32];
        snprintf(buf, sizeof buf, "%d", rc);
        die("llama_decode failed with code", buf);
    }
}

static void fill_batch(struct llama_batch * b, const llama_token * toks, int n, int pos0, int all_logits) {
    b->n_tokens = n;
    for (int i = 0; i < n; i++) {
        b->token[i] = toks[i];
        b->pos[i] = pos0 + i;
        b->n_seq_id[i] = 1;
        b->seq_id[i][0] = 0;
        b->logits[i] = all_logits || i == n - 1;
    }
}

static void run_greedy(struct llama_context * ctx, const struct llama_vocab * vocab,
                       char * line, int n_predict, int topk) {
    int n_vocab = llama_vocab_n_tokens(vocab);
    size_t len = unhex(line);
    llama_token * toks = malloc(sizeof(llama_token) * N_CTX);
    llama_token * gen = malloc(sizeof(llama_token) * N_CTX);
    int n_prompt = llama_tokenize(vocab, line, (int32_t) len, toks, N_CTX, true, false);
    if (n_prompt <= 0) die("prompt tokenizes to no tokens or more than n_ctx", NULL);
    if (n_prompt + n_predict > N_CTX) die("prompt + n_predict exceeds n_ctx", NULL);

    llama_memory_clear(llama_get_memory(ctx), true);
    struct llama_batch batch = llama_batch_init(N_CTX, 0, 1);

    printf("{\"prompt_tokens\":[");
    for (int i = 0; i < n_prompt; i++) printf("%s%d", i ? "," : "", toks[i]);
    printf("],\"top\":[");

    fill_batch(&batch, toks, n_prompt, 0, 0);
    decode_or_die(ctx, batch);

    int n_gen = 0, eog = 0;
    size_t text_cap = 1 << 16, text_len = 0;
    unsigned char * text = malloc(text_cap);
    for (int step = 0; step < n_predict; step++) {
        const float * logits = llama_get_logits_ith(ctx, -1);
        if (step) putchar(',');
        llama_token next = put_topk(logits, n_vocab, topk);
        gen[n_gen++] = next;
        if (llama_vocab_is_eog(vocab, next)) {
            eog = 1;
            break;
        }
        char piece[512];
        int np = llama_token_to_piece(vocab, next, piece, sizeof piece, 0, false);
        if (np < 0) die("token piece longer than 512 bytes", NULL);
        if (text_len + np > text_cap) die("generated text too long", NULL);
        memcpy(text + text_len, piece, np);
        text_len += np;
        if (step + 1 < n_predict) {
            fill_batch(&batch, &next, 1, n_prompt + step, 1);
            decode_or_die(ctx, batch);
        }
    }
    printf("],\"tokens\":[");
    for (int i = 0; i < n_gen; i++) printf("%s%d", i ? "," : "", gen[i]);
    printf("],\"eog\":%s,\"text_hex\":", eog ? "true" : "false");
    put_hex(text, text_len);
    putchar('}');
    free(text);
    free(toks);
    free(gen);
    llama_batch_free(batch);
}

// Parses a line of decimal token ids into toks (N_CTX of room); returns the count.
static int parse_ids(char * line, llama_token * toks, int n_vocab) {
    int n = 0;
    for (char * tok = strtok(line, " "); tok; tok = strtok(NULL, " ")) {
        if (n == N_CTX) die("token sequence longer than n_ctx (raise --ctx)", NULL);
        char * end;
        long id = strtol(tok, &end, 10);
        if (*end || id < 0 || id >= n_vocab) die("bad token id", tok);
        toks[n++] = (llama_token) id;
    }
    if (n == 0) die("empty token sequence", NULL);
    return n;
}

static void run_forced(struct llama_context * ctx, const struct llama_vocab * vocab,
                       char * line, int topk) {
    int n_vocab = llama_vocab_n_tokens(vocab);
    llama_token * toks = malloc(sizeof(llama_token) * N_CTX);
    int n = parse_ids(line, toks, n_vocab);

    llama_memory_clear(llama_get_memory(ctx), true);
    struct llama_batch batch = llama_batch_init(N_CTX, 0, 1);
    fill_batch(&batch, toks, n, 0, 1);
    decode_or_die(ctx, batch);

    printf("{\"tokens\":[");
    for (int i = 0; i < n; i++) printf("%s%d", i ? "," : "", toks[i]);
    printf("],\"top\":[");
    for (int i = 0; i < n; i++) {
        if (i) putchar(',');
        put_topk(llama_get_logits_ith(ctx, i), n_vocab, topk);
    }
    printf("]}");
    free(toks);
    llama_batch_free(batch);
}

// Full logits of the scored positions (from, from + stride, ..., and the last) to `out`.
static void run_logits(struct llama_context * ctx, const struct llama_vocab * vocab, char * line,
                       const struct options * o, FILE * out) {
    int n_vocab = llama_vocab_n_tokens(vocab);
    llama_token * toks = malloc(sizeof(llama_token) * N_CTX);
    int n = parse_ids(line, toks, n_vocab);

    llama_memory_clear(llama_get_memory(ctx), true);
    struct llama_batch batch = llama_batch_init(N_CTX, 0, 1);
    fill_batch(&batch, toks, n, 0, 0);
    for (int i = 0; i < n; i++) {
        batch.logits[i] = i == n - 1 || (i >= o->from && (i - o->from) % o->stride == 0);
    }
    decode_or_die(ctx, batch);

    long offset = ftell(out);
    printf("{\"tokens\":[");
    for (int i = 0; i < n; i++) printf("%s%d", i ? "," : "", toks[i]);
    printf("],\"offset\":%ld,\"positions\":[", offset);
    int first = 1;
    for (int i = 0; i < n; i++) {
        if (!batch.logits[i]) continue;
        printf("%s%d", first ? "" : ",", i);
        first = 0;
        if (fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, out) != (size_t) n_vocab) {
            die("cannot write logits to", o->out);
        }
    }
    printf("]}");
    free(toks);
    llama_batch_free(batch);
}

static int parse_int(const char * s, const char * what) {
    char * end;
    long v = strtol(s, &end, 10);
    if (*end || end == s || v < 0 || v > 1 << 24) die(what, s);
    return (int) v;
}

// argv[i..] are options; fills o or dies naming the bad one.
static void parse_options(int argc, char ** argv, int i, struct options * o) {
    for (; i < argc; i += 2) {
        const char * k = argv[i];
        if (i + 1 >= argc) die("option needs a value", k);
        const char * v = argv[i + 1];
        if (!strcmp(k, "--ctx")) o->n_ctx = parse_int(v, "bad --ctx");
        else if (!strcmp(k, "--ngl")) o->n_gpu_layers = parse_int(v, "bad --ngl");
        else if (!strcmp(k, "--threads")) o->n_threads = parse_int(v, "bad --threads");
        else if (!strcmp(k, "--stride")) o->stride = parse_int(v, "bad --stride");
        else if (!strcmp(k, "--from")) o->from = parse_int(v, "bad --from");
        else if (!strcmp(k, "--out")) o->out = v;
        else if (!strcmp(k, "--kv")) {
            if (!strcmp(v, "f32")) o->kv_type = GGML_TYPE_F32;
            else if (!strcmp(v, "f16")) o->kv_type = GGML_TYPE_F16;
            else die("--kv must be f32 or f16", v);
        } else if (!strcmp(k, "--fa")) {
            if (!strcmp(v, "on")) o->fa = LLAMA_FLASH_ATTN_TYPE_ENABLED;
            else if (!strcmp(v, "off")) o->fa = LLAMA_FLASH_ATTN_TYPE_DISABLED;
            else if (!strcmp(v, "auto")) o->fa = LLAMA_FLASH_ATTN_TYPE_AUTO;
            else die("--fa must be on, off or auto", v);
        } else die("unknown option", k);
    }
    if (o->n_ctx < 8) die("--ctx must be at least 8", NULL);
    if (o->n_threads < 1) die("--threads must be at least 1", NULL);
    if (o->stride < 1) die("--stride must be at least 1", NULL);
}

int main(int argc, char ** argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s MODEL greedy|forced|logits INPUT N_PREDICT TOPK [OPTIONS]\n"
                        "(options: see the comment at the top of llama_ref.c)\n", argv[0]);
        return 2;
    }
    const char * model_path = argv[1];
    const char * mode = argv[2];
    int n_predict = atoi(argv[4]);
    int topk = atoi(argv[5]);
    int greedy = strcmp(mode, "greedy") == 0;
    int logits = strcmp(mode, "logits") == 0;
    if (!greedy && !logits && strcmp(mode, "forced") != 0) die("mode must be greedy, forced or logits", mode);
    struct options o = {512, 0, 1, 1, 0, GGML_TYPE_F32, LLAMA_FLASH_ATTN_TYPE_DISABLED, NULL};
    parse_options(argc, argv, 6, &o);
    N_CTX = o.n_ctx;
    if (!logits && (topk < 1 || topk > 64)) die("TOPK must be in 1..64", argv[5]);
    if (logits && !o.out) die("logits mode needs --out PATH", NULL);
    if (greedy && (n_predict < 1 || n_predict >= N_CTX)) die("bad N_PREDICT", argv[4]);

    FILE * in = fopen(argv[3], "r");
    if (!in) die("cannot open input", argv[3]);
    FILE * out = NULL;
    if (logits) {
        out = fopen(o.out, "wb");
        if (!out) die("cannot open for writing", o.out);
    }

    llama_log_set(quiet_log, NULL);
    llama_backend_init();

    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = o.n_gpu_layers;
    struct llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) die("cannot load model", model_path);
    const struct llama_vocab * vocab = llama_model_get_vocab(model);

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = N_CTX;
    cp.n_batch = N_CTX;
    cp.n_ubatch = N_CTX;
    cp.n_seq_max = 1;
    cp.n_threads = o.n_threads;
    cp.n_threads_batch = o.n_threads;
    cp.type_k = o.kv_type;
    cp.type_v = o.kv_type;
    cp.flash_attn_type = o.fa;
    cp.no_perf = true;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) die("cannot create context", model_path);

    printf("{\"n_vocab\":%d,\"add_bos\":%s,\"add_eos\":%s,\"results\":[",
           llama_vocab_n_tokens(vocab),
           llama_vocab_get_add_bos(vocab) ? "true" : "false",
           llama_vocab_get_add_eos(vocab) ? "true" : "false");

    char * line = malloc(MAX_LINE);
    int first = 1;
    while (fgets(line, MAX_LINE, in)) {
        size_t n = strlen(line);
        if (n && line[n - 1] == '\n') line[--n] = 0;
        else if (n == MAX_LINE - 1) die("input line too long", NULL);
        if (!first) putchar(',');
        first = 0;
        if (greedy) run_greedy(ctx, vocab, line, n_predict, topk);
        else if (logits) run_logits(ctx, vocab, line, &o, out);
        else run_forced(ctx, vocab, line, topk);
        putchar('\n');
        fflush(stdout);
    }
    printf("]}\n");

    free(line);
    fclose(in);
    if (out && fclose(out) != 0) die("cannot write logits to", o.out);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
