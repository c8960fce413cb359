"""The ``magpie rotator`` process: runs the listeners assigned to its instance, and converges by itself.

Coordination is *persisted instance assignment and local reconciliation*:

- every rotator process keeps an instance record (:class:`magpie.coordination.instances.Heartbeat`, role
  ``rotator``) alive in Redis; one that stops refreshing disappears after ``MAGPIE_INSTANCE_TTL``;
- the **assigner** runs in whichever rotator process holds the leader lock ``rotator-assign``: it gives
  every enabled rotator that is unassigned or assigned to an instance without a live record to the live
  rotator instance with the fewest rotators, and moves one rotator per pass from the busiest to the
  idlest instance while their counts differ by more than one. Its writes carry the lock's fencing token
  (:func:`magpie.coordination.fencing.fence`), so a paused former leader cannot undo a newer one's assignment;
- every process **reconciles** every ``MAGPIE_ROTATOR_RECONCILE`` seconds, and at once when a change is
  announced on Redis pub/sub: it starts listeners newly assigned to it, stops removed or reassigned ones,
  rebinds one whose port or protocols changed, and applies other changes (credentials, policy, filters)
  in place without dropping connections. A lost notification only delays convergence by one cadence.
- pools are reloaded every ``MAGPIE_ROTATOR_POOL_REFRESH`` seconds and on change notifications.
- a process restarted on the same host takes, at start, the rotators of rotator instances on that host
  whose process has certainly exited (:func:`predecessor_dead`), instead of waiting for their records to
  expire; an instance that is alive but stuck keeps its rotators, so no port is bound twice;
- rotators without credentials listen only on a loopback ``MAGPIE_ROTATOR_HOST`` (elsewhere: state
  ``error``, not bound); client destinations pass :class:`magpie.rotator.policy.DestinationPolicy`.

Each listener's state (serving or the bind error, pool size, counters) is written to
``<prefix>rotator:<id>:state`` with a TTL, for ``magpie rotators list`` and the metrics.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import socket
import threading
import time

import redis as redis_lib
import sqlalchemy as sa

from magpie.base import redisconn
from magpie.base.egress import EgressPolicy
from magpie.coordination.fencing import fence
from magpie.coordination.instances import Heartbeat, InstanceRegistry
from magpie.coordination.leader import LeaderLock
from magpie.rotator.listener import Listener, ListenerSpec
from magpie.rotator.models import Rotator
from magpie.base.egress import parse_ports
from magpie.rotator.policy import DestinationPolicy
from magpie.rotator.pool import RoutePool, load_pool
from magpie.rotator.service import channel, list_rotators, load_rows
from magpie.coordination.throttle import FailureLog, FailureThrottle

log = logging.getLogger(__name__)

ROLE = "rotator"
ASSIGN_LOCK = "rotator-assign"


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and addresses in 127.0.0.0/8 or ``::1`` (where an open rotator may listen)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[] ")).is_loopback
    except ValueError:
        return False


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _proc_start(pid: int) -> str | None:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None
    when no such process is visible."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def process_identity() -> dict:
    """What tells this process from any other on the same host, across restarts and pid reuse: kernel
    ``boot_id``, pid namespace ``pid_ns``, ``pid`` and its start time ``proc_start`` (None where /proc is
    missing)."""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return {"boot_id": _read("/proc/sys/kernel/random/boot_id"), "pid_ns": pid_ns, "pid": os.getpid(),
            "proc_start": _proc_start(os.getpid())}


def predecessor_dead(record: dict, me: dict | None = None) -> bool:
    """True when the instance ``record`` (an instance record with :func:`process_identity` fields) belongs
    to a process that certainly exited: same host name, kernel boot and pid namespace as this process, and
    its pid is gone or now another process. False whenever that cannot be known (another host)."""
    me = me or process_identity()
    ident = record.get("identity") or {}
    if record.get("host") != socket.gethostname() or not me.get("boot_id") or not me.get("pid_ns"):
        return False
    if ident.get("boot_id") != me["boot_id"] or ident.get("pid_ns") != me["pid_ns"] or not ident.get("proc_start"):
        return False
    pid = int(record.get("pid") or 0)
    if pid <= 0:
        return False
    return _proc_start(pid) != ident["proc_start"]


def state_key(prefix: str, rotator_id: int) -> str:
    """Redis key of a rotator's published state (JSON with a TTL)."""
    return f"{prefix}rotator:{rotator_id}:state"


def read_states(client: redis_lib.Redis, prefix: str, ids: list[int]) -> dict[int, dict]:
    """Published states of rotators ``ids`` (missing ones are left out: not running anywhere)."""
    if not ids:
        return {}
    raw = redisconn.mget(client, [state_key(prefix, i) for i in ids])
    return {i: json.loads(v) for i, v in zip(ids, raw) if v}


def list_with_state(engine, client: redis_lib.Redis, prefix: str) -> list[dict]:
    """Every rotator (:func:`magpie.rotator.service.list_rotators`, by port) merged with its published state.

    Each dict gains ``state`` (``serving``, ``error``, ``not running`` when assigned but nothing is
    published, ``unassigned``), ``error`` (the reason, only in state ``error``), and the listener's
    figures, None when not serving: ``pool`` (eligible routes), ``connections`` (client connections since
    the listener started), ``active``, ``upstream_failures``, ``bytes_up`` / ``bytes_down`` (bytes).
    Raises ``redis.RedisError`` / SQLAlchemy errors from the reads.
    """
    rows = list_rotators(engine)
    states = read_states(client, prefix, [r["id"] for r in rows])
    for r in rows:
        st = states.get(r["id"], {})
        r["state"] = st.get("state", "unassigned" if not r["instance"] else "not running")
        for k in ("pool", "connections", "active", "upstream_failures", "bytes_up", "bytes_down"):
            r[k] = st.get(k)
        if st.get("error"):
            r["error"] = st["error"]
    return rows


def assign(engine, registry: InstanceRegistry, lock: LeaderLock | None) -> dict[str, int]:
    """One assigner pass (see the module doc); returns ``{"assigned": n, "moved": m, "instances": k}``.

    ``lock``: the held ``rotator-assign`` leader lock whose generation fences the writes (None: unfenced,
    for tests and one-shot tools). Raises :class:`magpie.coordination.fencing.StaleLeader` when a newer leader wrote.
    """
    live = [rec["id"] for rec in registry.list_live(role=ROLE)]
    out = {"assigned": 0, "moved": 0, "instances": len(live)}
    if not live:
        return out
    with engine.begin() as conn:
        if lock is not None:
            fence(conn, lock.fence_name, lock.generation)
        rows = conn.execute(sa.select(Rotator.id, Rotator.instance_id).where(Rotator.enabled)
                            .order_by(Rotator.id).with_for_update()).all()
        load = {i: 0 for i in live}
        orphans = []
        for rid, inst in rows:
            if inst in load:
                load[inst] += 1
            else:
                orphans.append(rid)
        moves: list[tuple[int, str]] = []
        for rid in orphans:
            target = min(load, key=lambda i: (load[i], i))
            load[target] += 1
            moves.append((rid, target))
        out["assigned"] = len(moves)
        busiest = max(load, key=lambda i: (load[i], i))
        idlest = min(load, key=lambda i: (load[i], i))
        if load[busiest] - load[idlest] > 1:
            movable = [rid for rid, inst in rows if inst == busiest]
            if movable:
                moves.append((movable[-1], idlest))
                out["moved"] = 1
        for rid, target in moves:
            conn.execute(sa.update(Rotator).where(Rotator.id == rid).values(
                instance_id=target, assigned_at=sa.func.now(), revision=Rotator.revision + 1))
    return out


class RotatorProcess:
    """One rotator instance (see the module doc).

    Args:
        settings: :class:`magpie.config.Settings` (``MAGPIE_ROTATOR_*``, instance heartbeat settings).
        engine / redis / keyring: PostgreSQL engine, Redis client, :class:`magpie.base.crypto.Keyring`.
        instance_id: default a new :func:`magpie.coordination.instances.new_id`.
    """

    def __init__(self, settings, *, engine, redis: redis_lib.Redis, keyring, instance_id: str | None = None):
        self.s = settings
        self.engine = engine
        self.redis = redis
        self.keyring = keyring
        self.prefix = settings.redis_prefix
        self.listeners: dict[int, Listener] = {}
        self.errors: dict[int, str] = {}
        identity = process_identity()
        self.heartbeat = Heartbeat(ROLE, redis, self.prefix, interval=settings.instance_heartbeat,
                                   ttl=settings.instance_ttl, instance_id=instance_id,
                                   fields={"identity": identity},
                                   dynamic={"rotators": lambda: sorted(le.spec.name for le in
                                                                       list(self.listeners.values())),
                                            "connections": lambda: sum(le.stats.active for le in
                                                                       list(self.listeners.values()))})
        self.id = self.heartbeat.id
        self.registry = InstanceRegistry(redis, self.prefix)
        self.lock = LeaderLock(redis, self.prefix, ASSIGN_LOCK,
                               ttl_ms=int(max(3.0, settings.rotator_reconcile * 3) * 1000))
        self.limit: asyncio.Semaphore | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self.failures: dict[tuple[str, str], int] = {}
        self.egress = EgressPolicy(settings.check_allow_private)
        self.destinations = DestinationPolicy(
            EgressPolicy(settings.rotator_allow_private, "MAGPIE_ROTATOR_ALLOW_PRIVATE"),
            settings.rotator_allowed_ports, resolve_timeout=settings.rotator_connect_timeout)
        self.throttle = FailureThrottle()
        self.auth_log = FailureLog(log, "rotator: failed client authentications")
        from magpie.coordination.ratelimit import BlockLimiter

        self.client_rate = float(getattr(settings, "rotator_client_rate", 0.0) or 0.0)
        self.rate_limiter = (BlockLimiter(redis, self.prefix, "rotator", block=16)
                             if self.client_rate > 0 else None)

    # -- main loop -----------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set; then stop listeners, release the lock, withdraw the instance."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.limit = asyncio.Semaphore(self.s.rotator_max_connections)
        self.heartbeat.start()
        await asyncio.to_thread(self.take_over_dead)
        watcher = threading.Thread(target=self._watch, name="magpie-rotator-notify", daemon=True)
        watcher.start()
        next_pool = 0.0
        try:
            while not stop.is_set():
                try:
                    await self.tick()
                    if time.monotonic() >= next_pool:
                        await self.refresh_pools()
                        next_pool = time.monotonic() + self.s.rotator_pool_refresh
                except Exception:
                    log.exception("rotator %s: reconciliation failed", self.id)
                waiter = asyncio.ensure_future(self._wake.wait())
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait([waiter, stopper], timeout=self.s.rotator_reconcile,
                                   return_when=asyncio.FIRST_COMPLETED)
                for f in (waiter, stopper):
                    f.cancel()
                if self._wake.is_set():
                    self._wake.clear()
                    next_pool = 0.0  # a change: reload pools too
        finally:
            self._stop.set()
            await self.close()

    def take_over_dead(self) -> int:
        """Take the rotators of rotator instances on this host whose process exited (a crash restarted by
        a supervisor), without waiting for their records to expire, and withdraw those records.
        Returns how many rotators were taken; Redis or PostgreSQL errors are logged and give 0."""
        taken = 0
        try:
            self.heartbeat.beat_once()  # this instance is live before it owns anything
            me = process_identity()
            for rec in self.registry.list_live(role=ROLE):
                if rec.get("id") == self.id or not predecessor_dead(rec, me):
                    continue
                with self.engine.begin() as conn:
                    n = conn.execute(sa.update(Rotator).where(Rotator.instance_id == rec["id"]).values(
                        instance_id=self.id, assigned_at=sa.func.now(), revision=Rotator.revision + 1)).rowcount
                self.registry.withdraw(rec["id"])
                taken += n
                log.info("rotator %s: took %d rotators of exited instance %s (pid %s)", self.id, n, rec["id"],
                         rec.get("pid"))
        except Exception:  # the assigner moves them once the record expires
            log.warning("rotator %s: taking over exited instances failed", self.id, exc_info=True)
        return taken

    async def close(self) -> None:
        """Stop every listener, release the assigner lock, withdraw the instance record."""
        self.auth_log.flush(force=True)
        for rid in list(self.listeners):
            await self._stop_listener(rid)
        await asyncio.to_thread(self._release)

    def _release(self) -> None:
        try:
            if self.lock.is_held():
                self.lock.release()
        except Exception:  # noqa: BLE001
            pass
        self.heartbeat.stop(withdraw=True)

    def _watch(self) -> None:
        """Pub/sub thread: a change announcement wakes the loop (reconcile + pool reload)."""
        while not self._stop.is_set():
            try:
                ps = self.redis.pubsub(ignore_subscribe_messages=True)
                ps.subscribe(channel(self.prefix))
                while not self._stop.is_set():
                    msg = ps.get_message(timeout=1.0)
                    if msg and self._loop is not None and self._wake is not None:
                        self._loop.call_soon_threadsafe(self._wake.set)
                ps.close()
            except Exception:  # noqa: BLE001 - Redis away: reconciliation on cadence still converges
                self._stop.wait(2.0)

    # -- one reconciliation --------------------------------------------------------------------------
    async def tick(self) -> None:
        """Assign (when leader), then reconcile this instance's listeners and publish their state."""
        await asyncio.to_thread(self._assign_if_leader)
        rows = await asyncio.to_thread(load_rows, self.engine, self.id)
        await self.reconcile(rows)
        await asyncio.to_thread(self._publish)
        self.auth_log.flush()

    def _assign_if_leader(self) -> None:
        try:
            held = self.lock.is_held() and self.lock.renew()
            if not held:
                held = self.lock.acquire()
            if held:
                got = assign(self.engine, self.registry, self.lock)
                if got["assigned"] or got["moved"]:
                    log.info("rotator assigner: %(assigned)d assigned, %(moved)d moved over %(instances)d "
                             "instances", got)
                    self.redis.publish(channel(self.prefix), "assigned")
        except Exception:
            log.warning("rotator assigner pass failed", exc_info=True)

    def _spec(self, row) -> ListenerSpec:
        password = self.keyring.decrypt(row.password_enc) if row.password_enc else None
        filters = dict(row.filters or {})
        own = parse_ports(filters["allowed_ports"]) if filters.get("allowed_ports") else None
        return ListenerSpec(row.id, row.name, int(row.port), frozenset(row.listen.split(",")), row.username,
                            password, row.policy, int(row.sticky_seconds), int(row.revision),
                            int(row.workspace_id), filters, own)

    async def reconcile(self, rows: list) -> None:
        """Make the running listeners match ``rows`` (this instance's assignments)."""
        wanted = {row.id: row for row in rows if row.enabled}
        for rid in [r for r in self.listeners if r not in wanted]:
            await self._stop_listener(rid)
        for rid in [r for r in self.errors if r not in wanted]:
            self.errors.pop(rid, None)
        for rid, row in wanted.items():
            spec = self._spec(row)
            cur = self.listeners.get(rid)
            if spec.password is None and not is_loopback_host(self.s.rotator_host):
                if cur is not None:
                    await self._stop_listener(rid)
                if rid not in self.errors:
                    self.errors[rid] = (f"refused: rotator {spec.name} has no password, and MAGPIE_ROTATOR_HOST "
                                        f"{self.s.rotator_host} is not loopback (an open rotator binds only to "
                                        "loopback)")
                    log.warning("rotator %s: %s", spec.name, self.errors[rid])
                continue
            if cur is not None and (cur.spec.port != spec.port or cur.spec.listen != spec.listen):
                await self._stop_listener(rid)
                cur = None
            if cur is None:
                await self._start_listener(spec)
            elif cur.spec.revision != spec.revision:
                refilter = cur.spec.filters != spec.filters or cur.spec.workspace_id != spec.workspace_id
                cur.update(spec)
                if refilter:
                    await self._refresh_pool(cur)
            if rid in self.listeners and not self.listeners[rid].serving:
                await self._stop_listener(rid)

    async def _start_listener(self, spec: ListenerSpec) -> None:
        pool = RoutePool([], spec.policy, spec.sticky_seconds)
        lis = Listener(spec, pool, host=self.s.rotator_host, tries=self.s.rotator_tries,
                       connect_timeout=self.s.rotator_connect_timeout, idle_timeout=self.s.rotator_idle_timeout,
                       on_failure=self._failed, limit=self.limit, destinations=self.destinations,
                       upstream_egress=self.egress, throttle=self.throttle, auth_log=self.auth_log,
                       rate_limiter=self.rate_limiter, client_rate=self.client_rate)
        try:
            await self._refresh_pool(lis)
            await lis.start()
        except OSError as exc:
            self.errors[spec.rotator_id] = f"cannot listen on {self.s.rotator_host}:{spec.port}: {exc.strerror}"
            log.warning("rotator %s: %s", spec.name, self.errors[spec.rotator_id])
            return
        self.errors.pop(spec.rotator_id, None)
        self.listeners[spec.rotator_id] = lis
        log.info("rotator %s listening on %s:%d (%s), %d routes%s", spec.name, self.s.rotator_host, spec.port,
                 "+".join(sorted(spec.listen)), len(pool),
                 ", open (no credentials): loopback only" if spec.password is None else "")

    async def _stop_listener(self, rid: int) -> None:
        lis = self.listeners.pop(rid, None)
        if lis is not None:
            await lis.stop()
            log.info("rotator %s stopped on port %d", lis.spec.name, lis.spec.port)

    async def _refresh_pool(self, lis: Listener) -> None:
        routes = await asyncio.to_thread(load_pool, self.engine, self.keyring, lis.spec.workspace_id,
                                         lis.spec.filters, egress=self.egress)
        lis.pool.replace(routes)

    async def refresh_pools(self) -> None:
        """Reload every listener's eligible routes."""
        for lis in list(self.listeners.values()):
            try:
                await self._refresh_pool(lis)
            except Exception:  # noqa: BLE001 - keep the previous pool until PostgreSQL answers
                log.warning("rotator %s: pool refresh failed; keeping %d routes", lis.spec.name, len(lis.pool))

    def _failed(self, spec: ListenerSpec, upstream) -> None:
        key = (spec.name, upstream.protocol)
        self.failures[key] = self.failures.get(key, 0) + 1

    def snapshot(self) -> dict[int, dict]:
        """State per rotator id this process runs or failed to start (what :func:`read_states` returns)."""
        out = {}
        for rid, lis in list(self.listeners.items()):
            st = lis.stats
            out[rid] = {"instance": self.id, "state": "serving", "pool": len(lis.pool), "port": lis.spec.port,
                        "connections": st.connections, "active": st.active, "refused": st.refused,
                        "no_route": st.no_route, "upstream_failures": st.upstream_failures,
                        "bytes_up": st.bytes_up, "bytes_down": st.bytes_down, "revision": lis.spec.revision,
                        "auth_failures": st.auth_failures, "destination_refused": st.destination_refused}
        for rid, err in self.errors.items():
            out[rid] = {"instance": self.id, "state": "error", "error": err}
        return out

    def _publish(self) -> None:
        ttl = int(max(5.0, self.s.rotator_reconcile * 3))
        pipe = self.redis.pipeline(transaction=False)
        for rid, st in self.snapshot().items():
            pipe.set(state_key(self.prefix, rid), json.dumps(st), ex=ttl)
        pipe.execute()
