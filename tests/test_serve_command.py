"""`dartree serve`'s command line: every option documented, the same model and decoder options as
`dartree generate`, and no need for the serve extra until the server starts."""

import argparse
import sys

import pytest

from dartree import cli
from dartree.serve.command import add_serve_parser, model_id


def serve_parser() -> argparse.ArgumentParser:
    return add_serve_parser(argparse.ArgumentParser(prog="dartree").add_subparsers())


def test_every_option_is_documented_in_help(capsys):
    parser = serve_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {"--host", "--port", "--max-queue", "--api-key", "--exact", "--threads", "--model",
            "--target", "--dtype", "--method", "--seed"} <= {o for a in options for o in a.option_strings}
    undocumented = [a.option_strings[0] for a in options if not (a.help or "").strip()]
    assert undocumented == []


def test_serve_takes_generates_model_and_decoder_options_with_the_same_defaults():
    def defaults(add):
        parser = argparse.ArgumentParser()
        add(parser)
        return vars(parser.parse_args([]))

    shared = {**defaults(cli.add_model_options), **defaults(cli.add_decoder_options)}
    serve = vars(serve_parser().parse_args([]))
    assert {k: serve[k] for k in shared} == shared
    assert serve["host"] == "127.0.0.1"  # loopback unless asked


def test_the_served_model_name():
    parse = serve_parser().parse_args
    assert model_id(parse([])) == "smollm2"
    assert model_id(parse(["--model", "tiny"])) == "tiny"
    assert model_id(parse(["--target", "/models/Qwen3-0.6B/"])) == "Qwen3-0.6B"
    assert model_id(parse(["--target", "/models/SmolLM2.Q4_1.gguf"])) == "SmolLM2.Q4_1"


def test_the_command_line_needs_no_starlette_until_the_server_starts(monkeypatch, capsys):
    for module in ("starlette", "uvicorn", "dartree.serve.app"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    with pytest.raises(SystemExit) as done:
        cli.main(["serve", "--help"])
    assert done.value.code == 0 and "--max-queue" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="dartree serve needs starlette and uvicorn"):
        cli.main(["serve", "--model", "tiny", "--device", "cpu"])
