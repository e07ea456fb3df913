"""Bootstrap auth and the advertised host of a PD pair (real HTTP, ZMQ and bootstrap server):
with ``--auth-token`` the prefill's bootstrap refuses unauthenticated writes, its ranks and the
decode authenticate, and ranks register under ``--advertise-host``."""
from __future__ import annotations

import argparse

import aiohttp
import pytest
from pd_helpers import dual, pd_body, start_pair

from bootstrap.client import BootstrapClient
from bootstrap.errors import BootstrapAuthError
from engine.pd.config import AUTH_TOKEN_ENV, PDConfig
from engine.serve_config import EngineServerConfig

pytestmark = pytest.mark.timeout(60)
TOKEN = "pd-test-token-7f3a"
ROUTE_ONE = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"


async def test_authenticated_pair_serves_and_refuses_strangers() -> None:
    # round_robin: the prefill announces each room with POST /register_dp_rank and the decode
    # asks with POST /query_dp_ranks, so both sides' POSTs carry the token.
    common = {"auth_token": TOKEN, "load_balance_method": "round_robin"}
    p = await start_pair(decode_over={"auth_token": TOKEN},
                         prefill_over={**common, "advertise_host": "localhost"})
    try:
        boot = f"http://127.0.0.1:{p.bport}"
        async with aiohttp.ClientSession() as s:
            (ps, pbody), (ds, dbody) = await dual(s, p.p_url, p.d_url,
                                                  pd_body([256, *b"guarded pair"], 4, p.bport))
            assert ps == 200 and ds == 200, (pbody, dbody)
            assert len(dbody["output_ids"]) == 4
            # The rank registered under the advertised host, and the decode dialled it.
            async with s.get(boot + ROUTE_ONE) as r:
                assert r.status == 200 and (await r.json())["rank_ip"] == "localhost"
            # Writes without (or with a wrong) token are refused.
            body = {"bootstrap_room": 5, "dp_rank": 0}
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                async with s.post(boot + "/register_dp_rank", json=body, headers=headers) as r:
                    assert r.status == 401 and "bearer token" in (await r.json())["error"]
        # The decode's bootstrap client authenticates its POSTs; one without the token is refused.
        assert isinstance(await p.ds.rank.client.query_dp_ranks("127.0.0.1", p.bport, [7]), dict)
        async with BootstrapClient() as stranger:
            with pytest.raises(BootstrapAuthError):
                await stranger.query_dp_ranks("127.0.0.1", p.bport, [7])
    finally:
        await p.decode.close()
        await p.prefill.close()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    EngineServerConfig.add_cli_args(parser)
    PDConfig.add_cli_args(parser)
    parser.add_argument("--etcd-prefix", default="/kvatlas")
    return parser.parse_args(argv)


def _config(argv: list[str]) -> PDConfig:
    args = _parse(argv)
    return PDConfig.from_cli_args(args, EngineServerConfig.from_cli_args(args), None)


def test_flags_env_fallback_and_advertised_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    cfg = _config(["--mode", "prefill", "--host", "127.0.0.1"])
    assert cfg.auth_token is None and cfg.public_host == "127.0.0.1"
    cfg = _config(["--mode", "decode", "--auth-token", "abc", "--advertise-host", "decode-0"])
    assert cfg.auth_token == "abc" and cfg.public_host == "decode-0"
    monkeypatch.setenv(AUTH_TOKEN_ENV, "from-env")
    cfg = _config(["--mode", "prefill", "--host", "0.0.0.0"])
    assert cfg.auth_token == "from-env"
    assert cfg.public_host not in ("0.0.0.0", ""), "a wildcard is never advertised"
    with pytest.raises(ValueError, match="advertise-host"):
        _config(["--mode", "prefill", "--advertise-host", "0.0.0.0"])
    with pytest.raises(ValueError, match="auth-token"):
        _config(["--mode", "prefill", "--auth-token", "two words"])
