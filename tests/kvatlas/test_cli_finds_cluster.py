"""The CLI as a new user meets it, in real subprocesses: ``generate``/``route`` reach the cluster
of the default run dir (``.kvatlas/run``) even when its router took another port than 8000; a
typo'd flag is named as unknown, with the closest one; a router that does not answer is one line
naming its address; chat messages OpenAI would refuse are refused before anything is sent; an
unknown model in ``index query`` is an error listing the known ones."""
from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvatlas.etcd_proc import free_port

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


async def run_cli(*args: str, cwd: Path) -> tuple[int, str, str]:
    """``python -m kvatlas ARGS`` in a real subprocess run in ``cwd``: (status, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvatlas", *args, cwd=str(cwd), env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(), err.decode()


def one_line_error(rc: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err, err
    return lines[-1]


@pytest.fixture
async def router_on_another_port() -> Any:
    """A router-shaped HTTP server on a free port (not 8000) that says which cluster it is."""
    seen: list[dict[str, Any]] = []

    async def generate(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"text": "answered-by-our-cluster"})

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


async def test_generate_reaches_the_default_run_dirs_router(
        router_on_another_port: Any, tmp_path: Path) -> None:
    url, seen = router_on_another_port
    run_dir = tmp_path / ".kvatlas" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "cluster.json").write_text(json.dumps({"router": {"url": url}}))
    rc, out, err = await run_cli("generate", "--prompt", "hi", cwd=tmp_path)
    assert rc == 0, err
    assert out.strip() == "answered-by-our-cluster" and seen[0]["text"] == "hi"


async def test_unknown_flag_is_named_with_a_suggestion(tmp_path: Path) -> None:
    (rc, _, err), (rc2, _, err2) = await asyncio.gather(
        run_cli("generate", "--mesage", "user=hi", cwd=tmp_path),
        run_cli("index", "query", "--model", "m", "--tokns", "1,2", cwd=tmp_path))
    line = one_line_error(rc, err)
    assert "unknown argument --mesage" in line and "did you mean --message?" in line, err
    assert "required" not in err, err
    line = one_line_error(rc2, err2)
    assert "unknown argument --tokns" in line and "did you mean --tokens?" in line, err2


async def test_a_router_that_does_not_answer_is_one_line_naming_it(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    results = await asyncio.gather(
        run_cli("generate", "--prompt", "hi", "--router", dead, cwd=tmp_path),
        run_cli("route", "--prompt", "hi", "--router", dead, cwd=tmp_path))
    for rc, _, err in results:
        line = one_line_error(rc, err)
        assert len(err.strip().splitlines()) == 1, err
        assert f"router at {dead} is not answering" in line and "ConnectionKey" not in line, err


@pytest.mark.parametrize(("chat", "want"), [
    ([{"role": "user"}], "messages[0].content: is required"),
    ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}],
     "messages[1].role: must be one of system, user, assistant, tool, developer, function"),
])
async def test_chat_messages_openai_refuses_are_refused_before_sending(
        chat: list[dict[str, Any]], want: str, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(chat))
    rc, _, err = await run_cli("generate", "--chat", str(path), "--router", dead, cwd=tmp_path)
    assert want in one_line_error(rc, err), err
    rc, _, err = await run_cli("generate", "--message", "user=a", "--message", "wizard=b",
                               "--router", dead, cwd=tmp_path)
    assert "messages[1].role: must be one of" in one_line_error(rc, err), err


async def test_index_query_of_an_unknown_model_lists_the_known_ones(
        etcd_endpoint: str, key_prefix: str, tmp_path: Path) -> None:
    rc, out, err = await run_cli("index", "query", "--model", "gpt-4o", "--prompt", "hi",
                                 "--etcd", etcd_endpoint, "--etcd-prefix", key_prefix,
                                 cwd=tmp_path)
    line = one_line_error(rc, err)
    assert "unknown model 'gpt-4o'" in line and "smollm2-135m" in line and out == "", err


def test_cluster_up_says_where_the_router_went_when_8000_was_busy() -> None:
    from kvatlas.commands.cluster import busy_port_note
    from kvatlas.launcher.state import ClusterState

    state = ClusterState(run_dir="/tmp/elsewhere", etcd="127.0.0.1:23790",
                         router={"url": "http://127.0.0.1:41234"}, model="tiny", topology={})
    note = busy_port_note(state, router_default_busy=True)
    assert note is not None and "port 8000 was busy" in note and "http://127.0.0.1:41234" in note
    assert "--run-dir /tmp/elsewhere" in note
    assert busy_port_note(state, router_default_busy=False) is None
