"""Typed application keys shared by the gateway's modules."""

from __future__ import annotations

from aiohttp import web

from services.gateway.config import GatewayConfig
from services.gateway.model_client import ModelClient

CONFIG = web.AppKey("config", GatewayConfig)
CLIENT = web.AppKey("client", ModelClient)  # the gateway's own model (--model-dir)
