"""The ``deimos`` command's own checks and conveniences, run in-process through ``cli.main``.

Oracles: the package version; the sampler's shared range check (``Bound.problem``: a flag, a
SamplingParams field and a server request field must word a bad value identically); the
registry's recorded sizes; the tokenizer and llama.cpp's committed greedy tokens for what
``run`` prints.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from testdata import model_path, reference

from deimos import __version__, registry
from deimos.cli import _read_prompt, build_parser, main, serve_config
from deimos.kernels.sampling import SAMPLING_BOUNDS, SamplingError, SamplingParams
from deimos.server.protocol import ChatCompletionRequest

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr); argparse's own errors exit through SystemExit."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A Deimos cache holding SmolLM2 (linked from the test data), gemma not pulled."""
    monkeypatch.setenv("DEIMOS_CACHE", str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    (models / SMOL).symlink_to(model_path(SMOL))
    return tmp_path / "cache"


def test_version(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"deimos {__version__}"


# ---- bad flags: one line naming the flag ---------------------------------------------------

@pytest.mark.parametrize("argv, flag, problem", [
    (("run", "smollm2", "hi", "-c", "0"), "-c/--ctx-size", "must be >= 2"),
    (("chat", "smollm2", "-c", "-5"), "-c/--ctx-size", "must be >= 2"),
    (("run", "smollm2", "hi", "-n", "0"), "-n/--max-tokens", "must be >= 1"),
    (("run", "smollm2", "hi", "--temperature", "-1"), "--temperature/--temp",
     SAMPLING_BOUNDS["temperature"].problem(-1.0)),
    (("run", "smollm2", "hi", "--top-p", "0"), "--top-p", SAMPLING_BOUNDS["top_p"].problem(0.0)),
    (("run", "smollm2", "hi", "--top-k", "1.5"), "--top-k", "must be an integer, got '1.5'"),
    (("serve", "smollm2", "--port", "70000"), "--port", "must be in [0, 65535]"),
    (("bench", "smollm2", "-r", "0"), "-r/--repetitions", "must be >= 1"),
], ids=["ctx-zero", "ctx-negative", "max-tokens", "temperature", "top-p", "top-k", "port",
        "rounds"])
def test_bad_flag_names_the_flag(capsys, argv, flag, problem):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"deimos {argv[0]}: error: argument {flag}: "), last
    assert problem in last
    assert "SamplingParams" not in err and "KVCache" not in err


@pytest.mark.parametrize("field, flag, value", [
    ("top_k", "--top-k", -1), ("min_p", "--min-p", 2.0), ("min_p", "--min-p", -0.5),
])  # the fields whose server range is the sampler's (OpenAI narrows the others)
def test_flag_field_and_request_word_a_bad_value_alike(capsys, field, flag, value):
    """One check (Bound.problem) behind the CLI flag, SamplingParams and the server's field."""
    problem = SAMPLING_BOUNDS[field].problem(value)
    _, _, err = run_cli(capsys, "run", "smollm2", "hi", flag, str(value))
    assert err.strip().splitlines()[-1].endswith(f": {problem}")
    with pytest.raises(SamplingError) as e:
        SamplingParams(**{field: value})
    assert (e.value.field, e.value.problem) == (field, problem)
    with pytest.raises(ValidationError) as v:
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                              **{field: value})
    error = v.value.errors()[0]
    assert error["loc"] == (field,) and error["msg"] == problem


@pytest.mark.parametrize("device, cuda, count, words", [
    ("foo", "12.8", 1, "--device 'foo': Deimos runs on cpu, cuda or cuda:N"),
    ("cuda:x", "12.8", 1, "--device 'cuda:x': Deimos runs on cpu, cuda or cuda:N"),
    ("cuda", None, 0, "is a CPU-only build; install a CUDA build of torch, or use --device cpu"),
    ("cuda", "12.8", 0, "sees no CUDA GPU"),
    ("cuda:7", "12.8", 1,
     "--device cuda:7: there is no GPU 7; this machine has 1 (cuda:0..cuda:0)"),
], ids=["unknown", "bad-index", "cpu-only-torch", "no-gpu", "absent-gpu"])
def test_bad_device_is_one_clear_line(capsys, monkeypatch, device, cuda, count, words):
    # the torch at hand, made to answer as each kind of machine would
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    code, out, err = run_cli(capsys, "run", "no-model-needed", "hi", "--device", device)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("deimos: error: --device "), err
    assert words in err


# ---- conveniences --------------------------------------------------------------------------

def test_pull_list_shows_sizes_and_what_is_cached(capsys, cache):
    code, out, err = run_cli(capsys, "pull", "--list")
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {m.name for m in registry.MODELS}
    assert "98 MB" in rows["smollm2-135m"] and " yes " in rows["smollm2-135m"]
    assert "253 MB" in rows["gemma3-270m"] and " no " in rows["gemma3-270m"]
    assert str(cache / "models") in err


def test_model_option_is_the_positional_model(capsys):
    path = str(model_path(SMOL))
    assert run_cli(capsys, "tokenize", path, "Hello world")[:2] == \
        run_cli(capsys, "tokenize", "-m", path, "Hello world")[:2]
    code, _, err = run_cli(capsys, "inspect", path, "-m", path)
    assert code == 2 and "the model is given twice" in err
    code, _, err = run_cli(capsys, "inspect")
    assert code == 2 and "inspect needs a MODEL (or -m MODEL)" in err


def test_quant_check_takes_short_names(capsys, cache, tmp_path):
    not_gguf = tmp_path / "ref.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    code, _, err = run_cli(capsys, "quant-check", "smollm2", str(not_gguf))
    # smollm2 was found in the cache: the complaint is the reference's
    assert code == 2 and str(not_gguf) in err and "no such file: smollm2" not in err


def test_serve_host_port_and_api_key_from_the_environment(monkeypatch):
    parse = build_parser().parse_args
    monkeypatch.setenv("DEIMOS_API_KEY", "from-env")
    cfg = serve_config(parse(["serve", "m", "--host", "0.0.0.0", "--port", "9000",
                              "--device", "cpu"]))
    assert (cfg.host, cfg.port, cfg.api_key) == ("0.0.0.0", 9000, "from-env")
    cfg = serve_config(parse(["serve", "m", "--port", "9001", "--api-key", "flag",
                              "--device", "cpu"]))
    assert (cfg.host, cfg.port, cfg.api_key) == ("127.0.0.1", 9001, "flag")
    monkeypatch.delenv("DEIMOS_API_KEY")
    cfg = serve_config(parse(["serve", "m", "--listen", "10.0.0.1:81", "--device", "cpu"]))
    assert (cfg.host, cfg.port, cfg.api_key) == ("10.0.0.1", 81, None)
    with pytest.raises(ValueError, match="--listen HOST:PORT or --host/--port, not both"):
        serve_config(parse(["serve", "m", "--listen", "10.0.0.1:81", "--port", "1"]))


def test_serve_chat_template_kwargs(capsys):
    parse = build_parser().parse_args
    cfg = serve_config(parse(["serve", "m", "--device", "cpu", "--chat-template-kwargs",
                              '{"enable_thinking": false, "reasoning_effort": "low"}']))
    assert dict(cfg.template_kwargs) == {"enable_thinking": False, "reasoning_effort": "low"}
    assert serve_config(parse(["serve", "m", "--device", "cpu"])).template_kwargs == ()
    for bad, words in (("[1]", "must be a JSON object"), ("{nope", "not JSON"),
                       ('{"tools": []}', "'tools' cannot be set")):
        with pytest.raises(SystemExit):
            parse(["serve", "m", "--chat-template-kwargs", bad])
        assert words in capsys.readouterr().err


def test_prompt_from_a_file_or_stdin(tmp_path, monkeypatch):
    parse = build_parser().parse_args
    f = tmp_path / "prompt.txt"
    f.write_text("Über den Wolken\n", encoding="utf-8")
    assert _read_prompt(parse(["run", "m", "-f", str(f)])) == "Über den Wolken\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    assert _read_prompt(parse(["run", "m", "-f", "-"])) == "from stdin"
    assert _read_prompt(parse(["run", "m", "as an argument"])) == "as an argument"
    with pytest.raises(ValueError, match="not both"):
        _read_prompt(parse(["run", "m", "hi", "-f", str(f)]))
    with pytest.raises(ValueError, match="run needs a PROMPT"):
        _read_prompt(parse(["run", "m"]))
    with pytest.raises(ValueError, match=f"-f {tmp_path / 'missing'}: No such file"):
        _read_prompt(parse(["run", "m", "-f", str(tmp_path / "missing")]))
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not UTF-8"):
        _read_prompt(parse(["run", "m", "-f", str(tmp_path / "bin")]))


def test_run_with_m_f_and_a_context_past_the_trained_one(capsys, caplog, tmp_path):
    """-m and -f give the same text as the positional form (llama.cpp's greedy tokens);
    -c past the model's trained context (8192) is allowed with a warning."""
    case = next(c for c in reference("SmolLM2-135M-Instruct.Q4_1.json")["cases"]
                if c["id"] == "german")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(case["prompt"], encoding="utf-8")
    code, out, err = run_cli(capsys, "run", "-m", str(model_path(SMOL)), "-f", str(prompt),
                             "--raw", "-n", "8", "--temperature", "0", "-c", "9000",
                             "--device", "cpu")
    assert code == 0, err
    from deimos.gguf import GGUFFile
    from deimos.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(model_path(SMOL)))
    assert out == tok.decode(case["tokens"][:8])  # --raw: stdout is the text, nothing else
    warned = err + caplog.text  # the log's stderr handler, or pytest's capture of it
    assert "context size 9000 is past" in warned and "trained context of 8192" in warned
    assert "-n 8" in err  # the cap cut the answer, and stderr says so


def test_chat_ends_at_exit_and_reset_forgets(capsys, monkeypatch):
    """``deimos chat`` reads turns from stdin: /reset starts over (the same first answer again,
    greedy), /exit ends the session (nothing after it is answered)."""
    turns = "Hello\n/reset\nHello\n/exit\nHello again\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(turns))
    code, out, err = run_cli(capsys, "chat", "-m", str(model_path(SMOL)), "-n", "4", "--temperature", "0",
                             "--device", "cpu")
    assert code == 0, err
    assert err.count("-n 4") == 2, err  # two answers, each cut at the cap
    answers = [a for a in out.split("\n") if a.strip()]
    assert len(answers) == 2 and answers[0] == answers[1], out


def test_cli_module_keeps_torch_out_of_the_light_commands():
    import subprocess
    import sys

    code = ("import sys; from deimos.cli import build_parser; build_parser(); "
            "print(json.dumps('torch' in sys.modules))")
    r = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) is False


@pytest.mark.parametrize("argv", [
    ["run", "m.gguf", "hello there", "--raw", "-n", "12", "--temperature", "0"],  # the README's order
    ["run", "m.gguf", "--raw", "-n", "12", "--temperature", "0", "hello there"],  # options first
    ["run", "--raw", "m.gguf", "-n", "12", "hello there", "--temperature", "0"],  # mixed
    ["-v", "run", "-n", "12", "m.gguf", "--raw", "--temperature", "0", "hello there"],
], ids=["prompt-first", "options-first", "mixed", "global-flag"])
def test_a_commands_options_and_positionals_in_any_order(argv):
    """A first-hour defect: `deimos run MODEL --raw -n 12 "prompt"` was refused with
    "unrecognized arguments" for the prompt (argparse's subparser stops taking positionals
    after options); each order gives the same request."""
    from deimos.cli import parse_cli

    a = parse_cli(build_parser(), argv)
    assert (a.command, a.model, a.prompt, a.raw, a.max_tokens, a.temperature) == \
        ("run", "m.gguf", "hello there", True, 12, 0.0)
    assert a.verbose == (argv[0] == "-v") and a.func is not None


def test_an_unknown_option_is_still_refused_by_name(capsys):
    from deimos.cli import parse_cli

    with pytest.raises(SystemExit) as e:
        parse_cli(build_parser(), ["run", "m.gguf", "--bogus", "hi"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
