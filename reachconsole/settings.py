"""Settings for reachconsole. Everything a deployment changes comes from the environment.

Embedded mode (no REDIS_URL, no MQTT_URL, no DATABASE_URL) runs the whole console in one
process on SQLite, an in-memory channel layer and Celery transport, and an embedded broker.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from urllib.parse import urlparse

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from messages.signing import keyring_parse
from reachconsole.core.env import env_bool, env_float, env_int, env_list, env_span, env_str
from reachconsole.core.tokens import tokens_parse

BASE_DIR = Path(__file__).resolve().parent.parent
RUN_DIR = Path(env_str("REACH_RUN_DIR", str(BASE_DIR / ".run")))
RUN_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = env_bool("DJANGO_DEBUG", False)
SECRET_KEY = env_str("DJANGO_SECRET_KEY")
if not SECRET_KEY:
    if not DEBUG and env_bool("REACH_REQUIRE_SECRET_KEY", False):
        raise ImproperlyConfigured("DJANGO_SECRET_KEY (or DJANGO_SECRET_KEY_FILE) must be set")
    # A key kept beside the SQLite file: sessions survive restarts of the embedded console.
    key_file = RUN_DIR / "secret_key"
    if not key_file.exists():
        key_file.write_text(secrets.token_urlsafe(50), encoding="utf-8")
        key_file.chmod(0o600)
    SECRET_KEY = key_file.read_text(encoding="utf-8").strip()

ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", "")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "axes",  # login throttling: see AXES_* below
    "reachconsole.core",
    "django_htmx",
    "channels",
    # Its templates and static files: /api/docs serves Swagger UI from here, not from a CDN.
    "ninja",
    "reachconsole",
    "roster",
    "directory",
    "messages.apps.A2AConfig",
    "alarms",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Database or Redis down: 503 + Retry-After instead of 500, for everything below it.
    "reachconsole.unavailable.UnavailableMiddleware",
    # WhiteNoise, async-capable: no sync-only middleware, so under ASGI a request that
    # waits holds no thread (reachconsole/core/idle.py).
    "reachconsole.static_files.StaticFilesMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    # A signed-in account with no role sees one page that says whom to ask.
    "reachconsole.readers.ReadersOnlyMiddleware",
    # A NUL in a page's query string: 400 with words, not a 500 from PostgreSQL.
    "reachconsole.error_pages.NulQueryMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # Last, as django-axes requires: it turns a refused login on any path into the lockout page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "reachconsole.urls"
ASGI_APPLICATION = "reachconsole.asgi.application"
WSGI_APPLICATION = "reachconsole.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            # `moment` (times a viewer may see in local time) as `date` is: in every template.
            "builtins": ["reachconsole.templatetags.moments"],
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                # The header's count of active, unacknowledged alarms.
                "alarms.context_processors.alarms_header",
            ],
        },
    },
]

# --- database -----------------------------------------------------------------------------
DATABASE_URL = env_str("DATABASE_URL") or f"sqlite:///{RUN_DIR / 'reachconsole.sqlite3'}"
try:
    # CONN_MAX_AGE 0: under ASGI every request runs in a thread of its own, and a connection
    # kept per thread ran PostgreSQL out of connections. The pool below reuses them instead.
    _db = dj_database_url.parse(DATABASE_URL, conn_max_age=0, conn_health_checks=True)
except ValueError as exc:
    raise ImproperlyConfigured(f"DATABASE_URL is not usable: {exc}") from exc
if _db["ENGINE"] == "django.db.backends.sqlite3":
    _db["CONN_MAX_AGE"] = 0
    _db["OPTIONS"] = {
        # IMMEDIATE takes the write lock when a transaction starts, so a read-then-write
        # claim cannot interleave with another writer (SQLite has no row locks).
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    # A file, not shared-cache memory: tests run threads that write concurrently.
    _db["TEST"] = {"NAME": str(RUN_DIR / "test-reachconsole.sqlite3")}
elif _db["ENGINE"] == "django.db.backends.postgresql":
    _pg_options = _db.setdefault("OPTIONS", {})
    if env_bool("REACH_PG_PREPARED", True):
        # Server-side binding lets psycopg prepare statements a connection runs often: the
        # directory's and the bridge's queries are planned once, not on every call (planning
        # was most of resolve()'s time, bench/resolve.py). Pooled connections keep what they
        # prepared. Turn off behind PgBouncer in transaction mode, which cannot keep
        # prepared statements.
        _pg_options.update(server_side_binding=True, prepare_threshold=5)
    if env_bool("REACH_DB_POOL", True):
        # One bounded pool per process: a request waits up to the timeout for a free
        # connection, then answers 503 (reachconsole/unavailable.py), instead of opening one
        # more and meeting "too many clients". Every process (Daphne, each Celery worker
        # process, beat) has its own pool: docs/deployment.md, "Sizing connections".
        # Min 0: Celery's Django fixup closes the pool around every task in a prefork
        # child, and a pool that opens a minimum connects twice per task instead of once.
        REACH_DB_POOL_MIN = env_int("REACH_DB_POOL_MIN", 0, minimum=0)
        REACH_DB_POOL_MAX = env_int("REACH_DB_POOL_MAX", 8, minimum=1)
        if REACH_DB_POOL_MAX < REACH_DB_POOL_MIN:
            raise ImproperlyConfigured(
                f"REACH_DB_POOL_MAX ({REACH_DB_POOL_MAX}) is below REACH_DB_POOL_MIN "
                f"({REACH_DB_POOL_MIN})"
            )
        _pg_options["pool"] = {
            "min_size": REACH_DB_POOL_MIN,
            "max_size": REACH_DB_POOL_MAX,
            "timeout": env_float("REACH_DB_POOL_TIMEOUT_S", 10.0, minimum=0.1),
            "name": "reachconsole",
        }
    # A new connection through a path that has stalled would otherwise wait for ever: the
    # pool's own workers open them, and a stuck one opens nothing until the path moves.
    _pg_options.setdefault("connect_timeout",
                           env_int("REACH_DB_CONNECT_TIMEOUT_S", 5, minimum=1))
DATABASES = {"default": _db}
# How long one query of a web request may run on PostgreSQL before its connection is cut off
# and the request answered 503 (reachconsole/core/query_bound.py: a stalled connection would
# hold the request, its thread and its connection for as long as the stall lasts); 0: no bound.
REACH_DB_QUERY_BOUND_S = env_float("REACH_DB_QUERY_BOUND_S", 5.0, minimum=0.0)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis: channel layer, cache, Celery --------------------------------------------------
# The console's name (reachconsole/core/identity.py): given here, or else read from its
# database, once a process, when first needed: the channel layer's and the cache's prefixes
# and the bridges' client ids and share group carry it.
REACH_CONSOLE_ID = env_str("REACH_CONSOLE_ID", "")
REDIS_URL = env_str("REDIS_URL") or None
EMBEDDED = REDIS_URL is None
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "reachconsole.core.channel_layer.ConsoleChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL], "prefix": env_str("REACH_CHANNEL_PREFIX", "")},
        }
    }
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_FUNCTION": "reachconsole.core.identity.cache_key",
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    # The cache holds more than a cache's worth here: counters, idempotency claims and
    # heartbeat claims. LocMemCache culls a third of its keys once it holds 300 (its default),
    # which would lose counts and let a duplicate through; one process's state fits easily.
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
            "OPTIONS": {"MAX_ENTRIES": 2_000_000},
        }
    }

CELERY_BROKER_URL = REDIS_URL or "memory://localhost/"
if REDIS_URL:
    # Redis can go away without closing the TCP connection (failover, NAT, firewall): bound
    # connects and reads, keep the connections alive, and let kombu check the long-lived
    # BRPOP/pub-sub connections, so a dead one is dropped and reconnected instead of waited
    # on forever. socket_timeout stays well above kombu's 1 s BRPOP timeout.
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "socket_connect_timeout": 5,
        "socket_timeout": 10,
        "socket_keepalive": True,
        "health_check_interval": 10,
    }
else:
    # The in-memory transport polls; its 1 s default would delay every embedded task.
    CELERY_BROKER_TRANSPORT_OPTIONS = {"polling_interval": 0.05}
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 4
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A worker rides out a broker outage of any length: it retries the connection forever (the
# default gives up after 100 attempts, about 45 minutes, and exits). Celery 5.7.0 must not be
# used: its worker dies for good on a Redis restart (pyproject.toml, tests/
# test_worker_survives_redis.py). Tasks stay running through a connection loss: every task is
# idempotent and guards its claims, and cancelling them on loss can kill the worker itself
# (celery#7185).
CELERY_BROKER_CONNECTION_RETRY = True
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
CELERY_BEAT_SCHEDULE_FILENAME = str(RUN_DIR / "celerybeat-schedule")
CELERY_TIMEZONE = "UTC"
# The worker logs through LOGGING below (JSON in production), not a root logger of its own.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# --- MQTT ---------------------------------------------------------------------------------
MQTT_URL = env_str("MQTT_URL") or None
if MQTT_URL and urlparse(MQTT_URL).scheme not in {"mqtt", "mqtts", "tcp"}:
    raise ImproperlyConfigured(f"MQTT_URL={MQTT_URL!r}: use mqtt://host:port or mqtts://host:port")
# Credentials: user:password in MQTT_URL (percent-encoded), else these (MQTT_PASSWORD_FILE
# works too). mqtts:// verifies the broker against MQTT_CA_FILE, else the system's CAs
# (messages/mqtt_client.py builds every client from these).
MQTT_USERNAME = env_str("MQTT_USERNAME") or None
MQTT_PASSWORD = env_str("MQTT_PASSWORD") or None
MQTT_CA_FILE = env_str("MQTT_CA_FILE") or None
if MQTT_CA_FILE and not Path(MQTT_CA_FILE).is_file():
    raise ImproperlyConfigured(f"MQTT_CA_FILE={MQTT_CA_FILE} is not a readable file")
MQTT_TOPIC_PREFIX = env_str("MQTT_TOPIC_PREFIX", "ooder")
REACH_EMBEDDED_MQTT_PORT = env_int("REACH_EMBEDDED_MQTT_PORT", 1883, minimum=1)
# Set by runconsole when it starts that broker: its known limits are information, not alarms.
REACH_EMBEDDED_BROKER = False
REACH_NODE_ID = env_str("REACH_NODE_ID", "console")
REACH_IDEMPOTENCY_TTL_S = env_int("REACH_IDEMPOTENCY_TTL_S", 3600, minimum=1)
# Retries (PROTOCOL.md "Outbound state machine").
REACH_RETRY_MAX_ATTEMPTS = env_int("REACH_RETRY_MAX_ATTEMPTS", 5, minimum=1)
REACH_RETRY_BASE_MS = env_int("REACH_RETRY_BASE_MS", 100, minimum=1)
REACH_RETRY_MAX_MS = env_int("REACH_RETRY_MAX_MS", 2000, minimum=1)
REACH_RETRY_MULTIPLIER = env_float("REACH_RETRY_MULTIPLIER", 2.0, minimum=1.0)
REACH_RETRY_JITTER = env_float("REACH_RETRY_JITTER", 0.2, minimum=0.0)
REACH_ACK_TIMEOUT_MS = env_int("REACH_ACK_TIMEOUT_MS", 3000, minimum=50)
REACH_RETRY_SWEEP_S = env_float("REACH_RETRY_SWEEP_S", 0.5, minimum=0.05)
# The retry-storm guard: transmissions of one task id per window, across the console.
REACH_TASK_MAX_SENDS = env_int("REACH_TASK_MAX_SENDS", 5, minimum=1)
REACH_TASK_WINDOW_S = env_int("REACH_TASK_WINDOW_S", 60, minimum=1)
# The message table is pruned by age (0 keeps everything); a decimal is taken (0.5 = 12 h).
REACH_RETENTION_DAYS = env_float("REACH_RETENTION_DAYS", 14.0, minimum=0.0)
# On PostgreSQL the history (a2a_message, a2a_transition) is partitioned by time, a partition
# per REACH_PARTITION_SPAN, made ahead by beat and dropped whole past the retention
# (messages/partitions.py). `off` keeps one table pruned by batched deletes, as on SQLite;
# it is read when the migration runs (a later change needs the procedure in docs/scaling.md).
REACH_PARTITIONS = env_bool("REACH_PARTITIONS", True)
REACH_PARTITION_SPAN_S = env_span("REACH_PARTITION_SPAN", "1d", minimum_s=10)
# Partitions kept made ahead of the clock: a beat that stops for this many spans is noticed
# before a write finds no partition (and a write that does makes its own and goes on).
REACH_PARTITIONS_AHEAD = env_int("REACH_PARTITIONS_AHEAD", 3, minimum=1)
# Content is not history: a payload is dropped this long after its row's last change once
# nothing can send it again (an open request keeps it); 0 keeps payloads as long as the row.
REACH_PAYLOAD_KEEP_HOURS = env_float("REACH_PAYLOAD_KEEP_HOURS", 24.0, minimum=0.0)
# Backpressure: messages held for one agent before sends to it answer BUSY at once.
REACH_QUEUE_LIMIT = env_int("REACH_QUEUE_LIMIT", 1000, minimum=1)
REACH_MONITOR = env_bool("REACH_MONITOR", True)
# Traffic between other nodes is recorded without its payload unless this is set.
REACH_STORE_OBSERVED_PAYLOADS = env_bool("REACH_STORE_OBSERVED_PAYLOADS", False)
# Keys whose values are masked wherever a payload or headers are shown (messages/redact.py).
REACH_REDACT_KEYS = frozenset(
    key.lower() for key in env_list("REACH_REDACT_KEYS", "password,token,secret,authorization"))
# MQTT 5 (session expiry) against real brokers; the embedded broker speaks 3.1.1 only.
MQTT_PROTOCOL = env_str("MQTT_PROTOCOL", "5")
if MQTT_PROTOCOL not in {"5", "3.1.1"}:
    raise ImproperlyConfigured(f"MQTT_PROTOCOL={MQTT_PROTOCOL!r}: use 5 or 3.1.1")
MQTT_SESSION_EXPIRY_S = env_int("MQTT_SESSION_EXPIRY_S", 3600, minimum=0)
# The open A2A-over-MQTT profile beside the native dialect (roster/profile.py): the bridges
# hear its retained Agent Cards (MQTT 5 only: presence is a user property). The root is the
# profile's own; another is for consoles that must not see each other's cards (tests).
REACH_A2A_PROFILE = env_bool("REACH_A2A_PROFILE", True)
REACH_A2A_ROOT = env_str("REACH_A2A_ROOT", "$a2a/v1").rstrip("/")
if set(REACH_A2A_ROOT) & set("+#") or not REACH_A2A_ROOT.startswith("$"):
    # The bridges tell the profile's messages from the native dialect's by the `$`.
    raise ImproperlyConfigured(f"REACH_A2A_ROOT={REACH_A2A_ROOT!r}: a topic that begins with "
                               "`$` (the profile's is $a2a/v1), without wildcards")
# The profile's requester timing, as the console follows observed traffic: a request with no
# reply within the first-reply timeout ends EXPIRED; a stream silent for the idle timeout
# after a reply too (the profile's defaults, 15 s and 30 s).
REACH_A2A_FIRST_REPLY_MS = env_int("REACH_A2A_FIRST_REPLY_MS", 15000, minimum=100)
REACH_A2A_STREAM_IDLE_MS = env_int("REACH_A2A_STREAM_IDLE_MS", 30000, minimum=100)
# The console as the profile's requester (messages/profile_send.py): its requester id
# `{org}/{unit}/{agent}` (its replies come on `{root}/reply/{id}/replies`), and the profile's
# retry rules: a first reply within REACH_A2A_FIRST_REPLY_MS or another attempt with fresh
# Correlation Data, at most REACH_A2A_MAX_ATTEMPTS, after the backoffs (ms) with ±jitter; a
# send without timeoutMs gets REACH_A2A_TIMEOUT_MS, room for every attempt.
REACH_A2A_REQUESTER = env_str("REACH_A2A_REQUESTER", "reachconsole/ops/"
                              + re.sub(r"[^A-Za-z0-9_.-]", "-", REACH_NODE_ID))
_requester = REACH_A2A_REQUESTER.split("/")
if len(_requester) != 3 or not all(re.fullmatch(r"[A-Za-z0-9_.-]+", p) for p in _requester):
    raise ImproperlyConfigured(f"REACH_A2A_REQUESTER={REACH_A2A_REQUESTER!r}: the profile's "
                               "{org}/{unit}/{agent}, each of A-Z a-z 0-9 _ . -")
REACH_A2A_MAX_ATTEMPTS = env_int("REACH_A2A_MAX_ATTEMPTS", 3, minimum=1)
try:
    REACH_A2A_BACKOFF_MS = [max(0, int(v)) for v in env_list("REACH_A2A_BACKOFF_MS",
                                                             "1000,2000,4000")] or [1000]
except ValueError:
    raise ImproperlyConfigured("REACH_A2A_BACKOFF_MS: milliseconds, comma-separated "
                               "(the profile's are 1000,2000,4000)") from None
REACH_A2A_JITTER = env_float("REACH_A2A_JITTER", 0.2, minimum=0.0)
REACH_A2A_TIMEOUT_MS = env_int("REACH_A2A_TIMEOUT_MS", 120000, minimum=100)
# The largest Agent Card taken (EMQX's A2A registry refuses larger by default too).
REACH_A2A_CARD_MAX_BYTES = env_int("REACH_A2A_CARD_MAX_BYTES", 65536, minimum=1024)
MQTT_MAX_QUEUED = env_int("MQTT_MAX_QUEUED", 10000, minimum=10)
# The MQTT keepalive, and how long a bridge waits for its own probe to come back before it
# calls an open connection dead and reconnects (a NAT, a load balancer or a paused VM that
# drops the connection's state without closing it; messages/mqtt_session.py).
MQTT_KEEPALIVE_S = env_int("MQTT_KEEPALIVE_S", 15, minimum=2)
REACH_BRIDGE = env_bool("REACH_BRIDGE", True)  # run the MQTT bridge in Celery workers
REACH_BRIDGE_INSTANCE = env_str("REACH_BRIDGE_INSTANCE", "1")
REACH_BRIDGE_BATCH = env_int("REACH_BRIDGE_BATCH", 500, minimum=1)
# Scaling out (README "Scaling out"): the bridges of one console share the inbound topics
# through MQTT 5 shared subscriptions in this group. Per console by default, so two consoles
# on one broker each get every message and their own bridges split it. Empty: the console's
# name (Bridge.from_settings).
REACH_BRIDGE_SHARE_GROUP = env_str("REACH_BRIDGE_SHARE_GROUP", "")
if set(REACH_BRIDGE_SHARE_GROUP) & set("/+#"):
    raise ImproperlyConfigured(f"REACH_BRIDGE_SHARE_GROUP={REACH_BRIDGE_SHARE_GROUP!r}: a "
                               "shared-subscription group name has no '/', '+' or '#'")
# auto: shared where the broker allows it, else one active bridge (an advisory lock in
# PostgreSQL); shared / single force either (messages/subscriptions.py INGEST_CHOICES).
REACH_BRIDGE_INGEST = env_str("REACH_BRIDGE_INGEST", "auto")
if REACH_BRIDGE_INGEST not in {"auto", "shared", "single"}:
    raise ImproperlyConfigured(f"REACH_BRIDGE_INGEST={REACH_BRIDGE_INGEST!r}: use auto, shared "
                               "or single")
# The outbox (messages/outbox.py): how long a bridge's claim on a SENT row lasts before
# another bridge may publish it again, and how often bridges look without being woken.
REACH_OUTBOX_CLAIM_S = env_float("REACH_OUTBOX_CLAIM_S", 10.0, minimum=1.0)
REACH_OUTBOX_POLL_S = env_float("REACH_OUTBOX_POLL_S", 1.0, minimum=0.05)
REACH_OUTBOX_BATCH = env_int("REACH_OUTBOX_BATCH", 500, minimum=1)
REACH_MAX_MESSAGE_BYTES = env_int("REACH_MAX_MESSAGE_BYTES", 256 * 1024, minimum=1024)
# Signed envelopes (messages/signing.py, docs/protocol.md "Signatures"): kid:secret pairs,
# newest first; the first signs, all verify. Empty: nothing is signed or checked, and every
# node's page says its traffic is unsigned. Strict: answers, heartbeats, DRAINs and requests
# to the console's agents that are not signed by the node they speak for change nothing.
REACH_SIGNING_KEYS = env_str("REACH_SIGNING_KEYS", "") or ""
try:
    keyring_parse(REACH_SIGNING_KEYS)
except ValueError as exc:
    raise ImproperlyConfigured(str(exc)) from None
REACH_REQUIRE_SIGNED = env_bool("REACH_REQUIRE_SIGNED", False)
if REACH_REQUIRE_SIGNED and not keyring_parse(REACH_SIGNING_KEYS):
    raise ImproperlyConfigured("REACH_REQUIRE_SIGNED=1 needs REACH_SIGNING_KEYS (kid:secret, "
                               "e.g. 2026-12:$(openssl rand -hex 32)): without a key nothing "
                               "can be checked, and every node would be refused")
# Readiness (reachconsole/health.py): /readyz answers 503 when, in a second of the last ten
# with at least REACH_READY_MIN_TRANSMISSIONS task requests taken by the broker, fewer than
# this share were answered (0 turns the check off). Shared by every console: all go 503 at once.
REACH_READY_MIN_DELIVERY_RATE = env_float("REACH_READY_MIN_DELIVERY_RATE", 0.5)
if REACH_READY_MIN_DELIVERY_RATE > 1:
    raise ImproperlyConfigured(
        f"REACH_READY_MIN_DELIVERY_RATE={REACH_READY_MIN_DELIVERY_RATE} is a share: 0 to 1")
REACH_READY_MIN_TRANSMISSIONS = env_int("REACH_READY_MIN_TRANSMISSIONS", 5, minimum=1)

# --- the roster ---------------------------------------------------------------------------
REACH_LEASE_TTL_MS = env_int("REACH_LEASE_TTL_MS", 15000, minimum=1000)
REACH_HEARTBEAT_MS = env_int("REACH_HEARTBEAT_MS", 5000, minimum=100)
if REACH_HEARTBEAT_MS >= REACH_LEASE_TTL_MS:
    raise ImproperlyConfigured(
        f"REACH_HEARTBEAT_MS ({REACH_HEARTBEAT_MS}) must be shorter than REACH_LEASE_TTL_MS "
        f"({REACH_LEASE_TTL_MS}), or every lease lapses between two heartbeats"
    )
REACH_LEASE_SWEEP_S = env_float("REACH_LEASE_SWEEP_S", 1.0, minimum=0.1)
# Connections that sweep a large backlog of lapsed leases at once (roster.services
# leases_expire): a first full batch means more are due, and the rest is shared out.
REACH_LEASE_SWEEP_WORKERS = env_int("REACH_LEASE_SWEEP_WORKERS", 2, minimum=1)
# Leases, staleness and silence are judged only over time a bridge heard the bus (the
# console's own outage is not the agents' fault). A console that runs no bridge at all
# (REACH_BRIDGE=0 everywhere, heartbeats over HTTP only) sets this to judge by the clock.
REACH_JUDGE_BY_CLOCK = env_bool("REACH_JUDGE_BY_CLOCK", False)
REACH_PID_LOOKUP_URL = env_str("REACH_PID_LOOKUP_URL") or None
# The cluster's node authority (roster/reconcile.py): an endpoint in the shape of
# `GET /api/cluster/nodes`. Unset: the console's own node table and heartbeats are the set.
REACH_CLUSTER_NODES_URL = env_str("REACH_CLUSTER_NODES_URL") or None
REACH_CLUSTER_NODES_TOKEN = env_str("REACH_CLUSTER_NODES_TOKEN") or ""
REACH_CLUSTER_NODES_SOURCE = env_str("REACH_CLUSTER_NODES_SOURCE", "studio")
REACH_RECONCILE_TTL_S = env_int("REACH_RECONCILE_TTL_S", 30, minimum=1)
# How long a run waits for the authority before it says UNKNOWN (the worker's start waits
# this long at most before its bridge starts).
REACH_RECONCILE_TIMEOUT_S = env_float("REACH_RECONCILE_TIMEOUT_S", 5.0, minimum=0.1)
REACH_MAX_METADATA_BYTES = env_int("REACH_MAX_METADATA_BYTES", 16 * 1024, minimum=256)

# --- alarms (alarms/evaluate.py) ---------------------------------------------------------
# Evaluated by beat this often; each judges the last 5 minutes of the kept numbers.
REACH_ALARM_EVAL_S = env_float("REACH_ALARM_EVAL_S", 5.0, minimum=1.0)
# An agent (or the whole console) with at least this many task requests ended in 5 minutes,
# of which fewer than this share completed, is failing.
REACH_ALARM_SUCCESS_MIN = env_float("REACH_ALARM_SUCCESS_MIN", 0.8)
if REACH_ALARM_SUCCESS_MIN > 1:
    raise ImproperlyConfigured(
        f"REACH_ALARM_SUCCESS_MIN={REACH_ALARM_SUCCESS_MIN} is a share: 0 to 1")
REACH_ALARM_MIN_TASKS = env_int("REACH_ALARM_MIN_TASKS", 5, minimum=1)
# An agent_failing or delivery_failing alarm clears only once the rate is this far back above
# REACH_ALARM_SUCCESS_MIN: a rate hovering around it raises one alarm, not a flapping series.
REACH_ALARM_CLEAR_MARGIN = env_float("REACH_ALARM_CLEAR_MARGIN", 0.05, minimum=0.0)
# Task requests to one agent found EXPIRED in 5 minutes that raise tasks_expiring.
REACH_ALARM_EXPIRED_MIN = env_int("REACH_ALARM_EXPIRED_MIN", 3, minimum=1)
# retention_behind fires once the oldest message is this far past REACH_RETENTION_DAYS: the
# prune (each minute) leaves about a minute while it keeps up.
REACH_ALARM_RETENTION_BEHIND_S = env_int("REACH_ALARM_RETENTION_BEHIND_S", 900, minimum=120)
# Cleared alarms are kept this long (0 keeps them all).
REACH_ALARM_RETENTION_DAYS = env_int("REACH_ALARM_RETENTION_DAYS", 30, minimum=0)

# Only one beat may run; every periodic task also guards its claims, so two are harmless.
CELERY_BEAT_SCHEDULE = {
    "leases-expire": {"task": "roster.tasks.leases_expire", "schedule": REACH_LEASE_SWEEP_S},
    "nodes-sweep": {"task": "roster.tasks.nodes_sweep", "schedule": max(REACH_LEASE_SWEEP_S, 2)},
    "deliveries-sweep": {"task": "messages.tasks.deliveries_sweep",
                         "schedule": REACH_RETRY_SWEEP_S},
    # Each minute, within a budget (messages/sweeps.py): what falls due is a minute's rows.
    "messages-prune": {"task": "messages.tasks.messages_prune", "schedule": 60},
    # Partitions made ahead and dropped past the retention: twice a span, at most a minute
    # apart, so a partition is gone within half a span of its last row expiring.
    "partitions-maintain": {"task": "messages.tasks.partitions_maintain",
                            "schedule": min(60.0, REACH_PARTITION_SPAN_S / 2)},
    # Each minute, so what falls due is a minute's worth of rows, never an hour's backlog.
    "payloads-drop": {"task": "messages.tasks.payloads_drop", "schedule": 60},
    # The kept in-flight/held counts against the rows they count (messages/backpressure.py).
    "loads-reconcile": {"task": "messages.tasks.loads_reconcile", "schedule": 30},
    "cluster-reconcile": {"task": "roster.tasks.cluster_reconcile",
                          "schedule": REACH_RECONCILE_TTL_S},
    # Deadlines for agents written around the services (roster.models.LeaseDeadline).
    "lease-deadlines-repair": {"task": "roster.tasks.lease_deadlines_repair", "schedule": 300},
    # The numbers kept per bucket, each key's rows folded into one (messages/rollups.py).
    "rollups-fold": {"task": "messages.tasks.rollups_fold", "schedule": 10},
    "alarms-evaluate": {"task": "alarms.tasks.alarms_evaluate", "schedule": REACH_ALARM_EVAL_S},
}

# --- northbound API auth ------------------------------------------------------------------
REACH_SERVICE_TOKENS = tokens_parse(env_list("REACH_SERVICE_TOKENS"))
REACH_TRUSTED_SOURCES = frozenset(
    env_list("REACH_TRUSTED_SOURCES", "studio,aiserver,bpm-server,scene-engine,im-ai")
)

REACH_LOGIN_MAX_FAILURES = env_int("REACH_LOGIN_MAX_FAILURES", 5, minimum=1)
REACH_LOGIN_LOCKOUT_S = env_int("REACH_LOGIN_LOCKOUT_S", 300, minimum=1)
# Across user names: one address trying many (password spraying), reachconsole/login.py.
REACH_LOGIN_MAX_FAILURES_PER_ADDRESS = env_int("REACH_LOGIN_MAX_FAILURES_PER_ADDRESS", 20,
                                               minimum=1)
# Login throttling with django-axes. Its backend runs first in every authenticate() call, so
# the console's login, the admin's and any view that checks a password are throttled alike.
# Failures are counted per (user name, address) pair: one user's failures never lock another
# user out, even behind one proxy address. The address is REMOTE_ADDR only
# (reachconsole/login.py client_address); behind a reverse proxy run Daphne with
# --proxy-headers so REMOTE_ADDR is the client's (docs/deployment.md). Its database handler:
# the counts are shared by every process and judged on the clock, and its tables come with
# the package's migrations. (Its cache handler joins user name and address into one key
# without a separator: user `bob1` from 92.168.1.10 would count against `bob` from
# 192.168.1.10.)
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_HANDLER = "reachconsole.login.LoginAttempts"  # axes' database handler, NUL-safe
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
# Read on every attempt, so the REACH_ settings (and tests overriding them) decide.
AXES_FAILURE_LIMIT = "reachconsole.login.failure_limit"
AXES_COOLOFF_TIME = "reachconsole.login.cool_off"
AXES_CLIENT_IP_CALLABLE = "reachconsole.login.client_address"
AXES_USERNAME_CALLABLE = "reachconsole.login.attempt_username"
AXES_LOCKOUT_CALLABLE = "reachconsole.login.lockout_response"
# A refused attempt during a lockout does not extend it: the page's "try again in" holds.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_RESET_ON_SUCCESS = True
# Refusals are in the audit trail (reachconsole/core/audit.py); no second log of successes.
AXES_DISABLE_ACCESS_LOG = True
AXES_ENABLE_ADMIN = False
REACH_ADMIN_USER = env_str("REACH_ADMIN_USER", "admin")
REACH_ADMIN_PASSWORD = env_str("REACH_ADMIN_PASSWORD")

# --- the web ------------------------------------------------------------------------------
# A refused form (no or an old CSRF token) gets the console's page with words, not Django's.
CSRF_FAILURE_VIEW = "reachconsole.error_pages.csrf_failure"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "roster:health"
LOGOUT_REDIRECT_URL = "login"
STATIC_URL = "static/"
STATIC_ROOT = Path(env_str("REACH_STATIC_ROOT", str(BASE_DIR / "staticfiles")))
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
STATICFILES_DIRS = [BASE_DIR / "static"]
WHITENOISE_USE_FINDERS = True  # serve straight from static/ without collectstatic
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
DATA_UPLOAD_MAX_MEMORY_SIZE = 1024 * 1024

SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_HTTPONLY = False  # htmx reads it for hx-headers
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
if not DEBUG and env_bool("REACH_HTTPS", False):
    SECURE_SSL_REDIRECT = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env_int("REACH_HSTS_SECONDS", 31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# One JSON object a line in production (fields of a line about a message:
# reachconsole/core/logs.py); plain text on embedded defaults (`make run`).
REACH_LOG_FORMAT = env_str("REACH_LOG_FORMAT") or ("text" if EMBEDDED else "json")
if REACH_LOG_FORMAT not in {"json", "text"}:
    raise ImproperlyConfigured(f"REACH_LOG_FORMAT={REACH_LOG_FORMAT!r}: use json or text")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "text": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
        "json": {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s",
            "rename_fields": {"asctime": "time", "levelname": "level", "name": "logger"},
            "json_ensure_ascii": False,
        },
    },
    "filters": {"refusals": {"()": "reachconsole.core.logs.RefusalsInOneLine"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": REACH_LOG_FORMAT}},
    "root": {"handlers": ["console"], "level": env_str("REACH_LOG_LEVEL", "INFO")},
    "loggers": {
        # A 403 for a person without the role is one line, not a traceback.
        "django.request": {"filters": ["refusals"]},
        "amqtt": {"level": "WARNING"},
        # Each failure and lockout is a warning; its bookkeeping (clean-ups) is not news.
        "axes": {"level": "WARNING"},
        "transitions": {"level": "WARNING"},
        "daphne": {"level": "WARNING"},
        "django.channels.server": {"level": "WARNING"},
        # One line per periodic task every second drowns what an operator needs to read.
        "celery.app.trace": {"level": "WARNING"},
        "celery.worker.strategy": {"level": "WARNING"},
        "celery.beat": {"level": "WARNING"},
    },
}
