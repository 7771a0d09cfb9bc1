"""Typed application keys shared by the gateway's modules."""

from __future__ import annotations

from aiohttp import web

from services.gateway.config import GatewayConfig
from services.gateway.generation import Mesh

CONFIG = web.AppKey("config", GatewayConfig)
MESH = web.AppKey("mesh", Mesh)
