"""Gateway settings."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common.config import ServiceConfig, add_common_flags, add_model_flags, build, flag


@dataclass(frozen=True, kw_only=True)
class GatewayConfig(ServiceConfig):
    host: str
    port: int
    model: str
    route_timeout_s: float  # how long to wait for the conductor's answer
    stall_timeout_s: float  # a request with no news from any worker for this long fails (504)
    default_chat_max_tokens: int  # when a chat request sets no max_tokens (completions default to 16)
    max_migrations: int  # times a request is resumed elsewhere after its first token or a failed KV handoff
    prefill_retries: int  # times a request is re-dispatched when its prefill is lost before the first token
    migration_timeout_s: float  # how long a resumption waits for an instance to take it
    probe_after_s: float  # a request quiet this long asks its instances whether they still hold it
    max_inflight: int  # requests this gateway holds at once; beyond, 429 (a backstop to admission)
    api_keys: str  # the key file (services/gateway/tenants.py); "" = open: no key needed
    max_body_bytes: int  # a bigger request body is answered 413
    fair_share_floor: int = 8  # a tenant without max_concurrent may always hold this many; beyond, a fair share (tenants.py)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if min(self.route_timeout_s, self.stall_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.max_migrations < 0 or self.prefill_retries < 0 or min(self.migration_timeout_s, self.probe_after_s) <= 0:
            raise ValueError("migration limits must be >= 0 and the migration timeout > 0")
        if self.max_body_bytes < 1024:
            raise ValueError("max body bytes must be >= 1024")
        if self.fair_share_floor < 0:
            raise ValueError("the fair share floor must be >= 0 (0 = no fair share)")
        if self.max_inflight < 1:
            raise ValueError("max in-flight must be >= 1")
        if self.default_chat_max_tokens < 1:
            raise ValueError("default chat max tokens must be >= 1")


def load(argv: list[str] | None = None) -> GatewayConfig:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description="moonbus gateway (OpenAI-compatible HTTP API)")
    add_common_flags(parser, "gateway")
    add_model_flags(parser)
    flag(parser, "--host", "MOONBUS_HOST", "127.0.0.1", help="HTTP bind address")
    flag(parser, "--port", "MOONBUS_PORT", 8000, int, help="HTTP port")
    flag(parser, "--route-timeout", "MOONBUS_ROUTE_TIMEOUT", 5.0, float, help="seconds to wait for a route", dest="route_timeout_s")
    flag(parser, "--stall-timeout", "MOONBUS_STALL_TIMEOUT", 120.0, float, help="seconds without progress before a request fails", dest="stall_timeout_s")
    flag(parser, "--default-chat-max-tokens", "MOONBUS_DEFAULT_CHAT_MAX_TOKENS", 512, int, help="max_tokens of a chat request that sets none")
    flag(parser, "--max-migrations", "MOONBUS_MAX_MIGRATIONS", 3, int,
                help="times a request is resumed on another instance after its first token (or after its KV could not "
                     "reach its decode node, or its decode instance was lost)")
    flag(parser, "--prefill-retries", "MOONBUS_PREFILL_RETRIES", 2, int,
                help="times a request whose prefill is lost before its first token is dispatched again")
    flag(parser, "--migration-timeout", "MOONBUS_MIGRATION_TIMEOUT", 30.0, float, dest="migration_timeout_s",
                help="seconds a resumed request waits for an instance to take it")
    flag(parser, "--probe-after", "MOONBUS_PROBE_AFTER", 5.0, float, dest="probe_after_s",
                help="seconds without progress after which a request checks that an instance still holds it")
    flag(parser, "--api-keys", "MOONBUS_API_KEYS_FILE", "",
                help="file of hashed API keys and their tenants (moonbus keys); '' = open, no key needed")
    flag(parser, "--max-body-bytes", "MOONBUS_MAX_BODY_BYTES", 4 << 20, int, help="larger bodies get 413")
    flag(parser, "--max-inflight", "MOONBUS_MAX_INFLIGHT", 256, int,
                help="requests this gateway holds at once; more are answered 429 with Retry-After")
    flag(parser, "--fair-share-floor", "MOONBUS_FAIR_SHARE_FLOOR", 8, int,
                help="a tenant whose key sets no --max-concurrent may always hold this many requests; beyond, while "
                     "other tenants hold some, at most an equal share of all in flight (0 = no fair share)")
    args = parser.parse_args(argv)
    return build(GatewayConfig, args, home=Path(args.home))
