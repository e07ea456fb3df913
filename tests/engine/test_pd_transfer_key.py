"""The KV transfer key through a real PD pair (HTTP, bootstrap, ZMQ, torch): read from
``$KVATLAS_TRANSFER_KEY`` into the instance's transfer config, a keyed pair serves, and a decode
without the prefill's key is refused at registration instead of consuming its KV."""
from __future__ import annotations

import argparse

import aiohttp
import pytest
from pd_helpers import dual, fast_transfer, pd_body, start_pair

from engine.pd.config import PDConfig
from engine.serve_config import EngineServerConfig

pytestmark = pytest.mark.timeout(60)
KEY = "pd-transfer-key-0123456789abcdef"


def test_instance_config_reads_the_key_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    EngineServerConfig.add_cli_args(parser)
    PDConfig.add_cli_args(parser)
    parser.add_argument("--etcd-prefix", default="/kvatlas")
    monkeypatch.setenv("KVATLAS_TRANSFER_KEY", KEY)
    args = parser.parse_args(["--mode", "decode", "--model", "tiny"])
    cfg = PDConfig.from_cli_args(args, EngineServerConfig.from_cli_args(args), None)
    assert cfg.transfer.key == KEY
    with pytest.raises(SystemExit):  # there is no flag that could put it on a command line
        parser.parse_args(["--mode", "decode", "--transfer-key", KEY])


@pytest.mark.parametrize("decode_key", [KEY, None])
async def test_keyed_pair(decode_key: str | None) -> None:
    p = await start_pair(decode_over={"transfer": fast_transfer(key=decode_key)},
                         prefill_over={"transfer": fast_transfer(key=KEY)})
    try:
        async with aiohttp.ClientSession() as s:
            (ps, pbody), (ds, dbody) = await dual(s, p.p_url, p.d_url,
                                                  pd_body([256, *b"keyed pair"], 4, p.bport))
        if decode_key == KEY:
            assert ps == 200 and ds == 200, (pbody, dbody)
            assert len(dbody["output_ids"]) == 4
        else:
            assert ds != 200, dbody
            assert "KVATLAS_TRANSFER_KEY" in str(dbody), dbody
            assert p.ps.sender.stats["auth_failures"] >= 1
    finally:
        await p.decode.close()
        await p.prefill.close()
