"""Keys of the router's state in its aiohttp app."""
from __future__ import annotations

from aiohttp import web

from router.dispatch import Dispatcher
from router.health import HealthChecker
from router.state import RouterState

STATE = web.AppKey("router_state", RouterState)
DISPATCHER = web.AppKey("router_dispatcher", Dispatcher)
HEALTH = web.AppKey("router_health", HealthChecker)
