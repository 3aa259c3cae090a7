"""``clef mcp``: the ``decide`` tool over stdio, driven by the official ``mcp`` client's stdio transport
spawning ``python -m clef_runtime.cli mcp --model tiny``: the same tool as ``POST /mcp`` lists, answers equal
to the engine's (what ``clef decide`` prints), bad bodies as tool errors naming the field, logs on stderr
only; and the command's flags, usage errors and a model that cannot load."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import mcp_types
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.session import IncomingMessage
from mcp.client.stdio import stdio_client

from clef_runtime.engine.clef import Clef
from clef_runtime.options import ENGINE_OPTIONS
from clef_runtime.server.mcp.tool import DECIDE_TOOL
from tests.helpers import run_cli, run_cli_process
from tests.server.mcp.test_classifiers_mcp import named_tools_match
from tests.server.mcp.test_mcp import INITIALIZE
from tests.test_options import subcommand_flags

REQUEST: dict[str, Any] = {
    "state": {"ticket": "Charged twice, please refund today."},
    "questions": {
        "refund": {"type": "noul", "instructions": "Is a refund requested?"},
        "team": {"type": "choice", "criteria": {"billing": "charges, refunds", "tech": None}},
        "urgency": {"type": "score", "criteria": ["can wait", "this week", "today"]},
    },
}
BAD_REQUEST: dict[str, Any] = {"state": "s", "questions": {"q": {"type": "score", "criteria": {"0": "low"}}}}
README = Path(__file__).resolve().parents[1] / "README.md"


def test_clef_mcp_takes_every_engine_option() -> None:
    flags = subcommand_flags("mcp")
    assert "--model" in flags
    assert {option.flag for option in ENGINE_OPTIONS} <= flags


def test_engine_flags_and_variables_reach_the_loaded_model(monkeypatch: pytest.MonkeyPatch) -> None:
    import clef_runtime.model.kernels as kernels
    from clef_runtime import mcp_command as mcp_stdio
    from clef_runtime.engine import clef as engine_clef
    from clef_runtime.options import EngineOptions

    threads: list[dict[str, Any]] = []
    loads: list[tuple[str, EngineOptions]] = []
    monkeypatch.setattr(kernels, "configure_cpu_threads", lambda *a, **k: threads.append(k) or 2)
    monkeypatch.setattr(engine_clef.Clef, "load", lambda model, options: loads.append((model, options)))
    monkeypatch.setattr(mcp_stdio, "serve_stdio", lambda load: load() or 0)  # load as serving would
    monkeypatch.setenv("CLEF_PREFILL_CHUNK", "64")
    done = run_cli("mcp", "--model", "tiny", "--cache-mb", "0", "--weights", "fp32", "--image-mode", "g256")
    assert done.returncode == 0, done.stderr
    ((model, options),) = loads
    assert model == "tiny"
    assert (options.cache_mb, options.weights, options.image_mode) == (0, "fp32", "g256")
    assert options.prefill_chunk == 64
    # The model computes on the server's engine thread, which starts its own CPU thread team: none here.
    assert threads == [{"start_pool": False}]


def test_a_bad_engine_option_is_a_usage_error_before_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    import clef_runtime.model.kernels as kernels
    from clef_runtime import mcp_command as mcp_stdio

    monkeypatch.setattr(kernels, "configure_cpu_threads", lambda *a, **k: 2)
    monkeypatch.setattr(mcp_stdio, "serve_stdio", lambda load: pytest.fail("served despite a bad option"))
    done = run_cli("mcp", "--model", "tiny", "--weights", "nope")
    assert done.returncode == 2
    assert done.stdout == ""
    assert "--weights" in done.stderr


INITIALIZE_LINE = json.dumps(INITIALIZE)


def _bad_option(case: str, tmp_path: Path) -> tuple[list[str], str]:
    """The flags of one option that passes parsing but that the model load would refuse, and the text its
    error names."""
    if case == "head":
        return ["--head", f"billing={tmp_path / 'no-such-head'}"], "--head billing="
    if case == "calibration":
        broken = tmp_path / "calibration.json"
        broken.write_text("{not json", encoding="utf-8")
        return ["--calibration", str(broken)], f"--calibration {broken}"
    return ["--image-max-tokens", "50"], "--image-max-tokens"


@pytest.mark.parametrize("case", ["head", "calibration", "image_max_tokens"])
def test_an_option_the_load_would_refuse_is_a_usage_error_before_serving(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, case: str
) -> None:
    import clef_runtime.model.kernels as kernels
    from clef_runtime import mcp_command as mcp_stdio

    monkeypatch.setattr(kernels, "configure_cpu_threads", lambda *a, **k: 2)
    monkeypatch.setattr(mcp_stdio, "serve_stdio", lambda load: pytest.fail("served despite a bad option"))
    flags, named = _bad_option(case, tmp_path)
    done = run_cli("mcp", "--model", "tiny", *flags)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("clef mcp: error: ") and named in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.slow  # a new interpreter
def test_a_missing_head_directory_is_refused_before_the_handshake(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    done = run_cli_process(
        "mcp", "--model", "tiny", "--head", f"billing={missing}", stdin=INITIALIZE_LINE + "\n"
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""  # the agent's initialize got no answer: the server never started
    assert done.stderr == f"clef mcp: error: --head billing={missing}: not a directory\n"


@pytest.mark.slow  # a new interpreter
def test_a_line_that_is_not_a_json_rpc_message_gets_an_error_and_the_next_line_is_served() -> None:
    lines = [
        INITIALIZE_LINE,
        "not json",
        "[1, 2]",
        json.dumps({"jsonrpc": "2.0", "id": 2}),
        json.dumps({"jsonrpc": "1.0", "id": 3, "method": "tools/list"}),
        json.dumps({"jsonrpc": "2.0", "id": 4, "method": "tools/list", "params": [1]}),
        json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        json.dumps({"jsonrpc": "2.0", "id": 5, "method": "tools/list"}),
    ]
    with subprocess.Popen(
        [sys.executable, "-m", "clef_runtime.cli", "mcp", "--model", "tiny"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as process:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write("".join(line + "\n" for line in lines))
        process.stdin.flush()
        replies = []
        # Each malformed line is answered before the next line is read, so all come before tools/list's.
        while not replies or replies[-1].get("id") != 5:
            line = process.stdout.readline()
            assert line, f"stdout closed after {replies}"
            replies.append(json.loads(line))
        process.stdin.close()
        assert process.wait(timeout=60) == 0
    # initialize's reply comes from the server's task and the malformed lines' from the reader's: it may
    # come after some of them. The malformed lines are answered in their order, all before tools/list.
    (initialized,) = [reply for reply in replies if reply.get("id") == 1]
    not_json, *errors, listed = [reply for reply in replies if reply is not initialized]
    assert initialized["id"] == 1 and "result" in initialized
    assert not_json["id"] is None and not_json["error"]["code"] == -32700
    assert not_json["error"]["message"].startswith("parse error: ")  # then the JSON parser's reason
    assert [(error["id"], error["error"]["code"], error["error"]["message"]) for error in errors] == [
        (None, -32600, "invalid request: a JSON-RPC message is a JSON object"),
        (None, -32600, "invalid request: method: Field required"),
        (None, -32600, "invalid request: jsonrpc: Input should be '2.0'"),
        (None, -32602, "invalid params: params: Input should be an object"),
    ]
    assert [tool["name"] for tool in listed["result"]["tools"]] == ["decide"]


def test_the_readmes_desktop_agent_config_launches_clef_mcp() -> None:
    from clef_runtime.cli import build_parser

    section = re.search(r"^### MCP\n(.*?)(?=^#+ )", README.read_text(encoding="utf-8"), flags=re.S | re.M)
    assert section is not None
    (config,) = re.findall(r"^```json\n(.*?)^```", section.group(1), flags=re.S | re.M)
    (server,) = json.loads(config)["mcpServers"].values()
    assert Path(server["command"]).name == "clef"
    args = build_parser().parse_args(server["args"])
    assert args.command == "mcp"


async def _session_of_calls(
    errlog: io.TextIOBase,
) -> tuple[str, list[mcp_types.Tool], list[Any], list[Any]]:
    """Spawn ``clef mcp --model tiny`` through the client's stdio transport; list the tools and call
    ``decide`` with a good and a bad request. Returns (the initialize result's instructions, tools, results,
    anything on stdout that was not a protocol message)."""
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "clef_runtime.cli", "mcp", "--model", "tiny"],
        # The test run's settings (its cache directory, fp32 compute) reach the server as they reach the CLI.
        env=dict(os.environ),
    )
    stray: list[Any] = []

    async def on_message(message: IncomingMessage) -> None:
        if isinstance(message, Exception):  # a line on stdout that is not JSON-RPC
            stray.append(message)

    async with (
        stdio_client(params, errlog=errlog) as (read, write),
        ClientSession(read, write, message_handler=on_message) as session,
    ):
        initialized = await session.initialize()
        tools = (await session.list_tools()).tools
        results = [await session.call_tool("decide", REQUEST), await session.call_tool("decide", BAD_REQUEST)]
    return initialized.instructions or "", tools, results, stray


@pytest.mark.slow  # a new interpreter loads the tiny model
def test_clef_mcp_serves_decide_on_stdio_with_the_engines_answers(tiny: Clef, tmp_path: Path) -> None:
    log_path = tmp_path / "stderr.log"
    with log_path.open("w+", encoding="utf-8") as errlog:
        instructions, tools, (good, bad), stray = asyncio.run(_session_of_calls(errlog))
    assert tools == [DECIDE_TOOL]  # the definition POST /mcp lists
    assert named_tools_match(instructions, tools)  # no classifier tools over stdio

    assert not good.is_error
    # A fresh engine on the same weights and options: its state cache starts empty, as the server's did.
    expected = Clef(tiny.model, tiny.options).decide(REQUEST)
    assert good.structured_content == expected
    assert json.loads(good.content[0].text) == expected

    assert bad.is_error
    text = bad.content[0].text
    assert text.startswith("invalid request: questions.q.criteria: "), text

    # Logs went to stderr, and stdout carried protocol messages only.
    assert stray == []
    log = log_path.read_text(encoding="utf-8")
    assert "untrained" in log and "serving the decide tool on stdio" in log


@pytest.mark.slow  # a new interpreter
def test_a_model_that_cannot_load_ends_clef_mcp_with_status_1(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with subprocess.Popen(
        [sys.executable, "-m", "clef_runtime.cli", "mcp", "--model", str(missing)],
        stdin=subprocess.PIPE,  # held open: the server does not stop for want of a client
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        status = process.wait(timeout=300)
        assert process.stdout is not None and process.stderr is not None
        stdout, stderr = process.stdout.read(), process.stderr.read()
        assert process.stdin is not None
        process.stdin.close()
    assert status == 1, stderr
    assert stdout == ""
    assert "Traceback" not in stderr
    assert str(missing) in stderr
