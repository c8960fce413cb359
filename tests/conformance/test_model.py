"""Randomized interleaving of claim / renew / complete / remove / retry / import / stall calls from several
simulated workers and of the operator's calls (update, remove, drain, obliterate, respread, enqueue at/in,
pause, reprocess), checked step by step against a small reference model of the schedule."""

from __future__ import annotations

import math
import random

import pytest

from magpie.errors import Refusal
from magpie.queue import LeaseLost, Payload, QueueError
from magpie.base.routes import Route

STEPS = 10_000
"""Steps of the full run (slow tier); the default tier runs the first :data:`QUICK_STEPS` of the sequence."""
QUICK_STEPS = 4_000
MEMBERS = [f"{i:024x}" for i in range(30)]


def payload(member, ws):
    i = int(member, 16)
    return Payload(i, Route("http", "127.0.0.1", 4000 + i), member, sorted(ws)).encode()


class Model:
    """What the schedule must look like: scores, workspace sets, dead set, stall and retry counts."""

    def __init__(self, q, now, interval, lease, max_stalled):
        self.q, self.now, self.interval, self.lease, self.max_stalled = q, now, interval, lease, max_stalled
        self.score: dict[str, float] = {}
        self.ws: dict[str, set[int]] = {}
        self.dead: dict[str, int] = {}
        self.stalls: dict[str, int] = {}
        self.suspect: dict[str, int] = {}  # started stalls since the last completion
        self.started: dict[str, float] = {}  # start marks: member -> lease score
        self.retries: dict[str, int] = {}
        self.paused = False

    def shard(self, m):
        return self.q.shard_of(m)

    def schedule(self, members, w):
        step = self.interval / len(members)
        out = {"new": 0, "merged": 0, "unchanged": 0}
        for j, m in enumerate(members):
            off = int(j * step)
            if m not in self.ws:
                self.ws[m] = {w}
                self.score[m] = self.now + off
                out["new"] += 1
                continue
            changed = w not in self.ws[m]
            self.ws[m].add(w)
            if m not in self.score and m not in self.dead:
                self.score[m] = self.now + off
                changed = True
            out["merged" if changed else "unchanged"] += 1
        return out

    def pop(self, n):
        if self.paused:
            return []
        parts = getattr(self.q, "parts", None)
        if not parts:
            return self.pop_from(n, lambda m: True)
        # the partitioned schedule: the starting partition rotates, the count is split evenly, what a
        # partition could not fill goes to the partitions that filled their share, then to those not asked
        k = len(parts)
        start = (self.q._turn - 1) % k  # the claim just made (a paused one rotates too)
        order = [p.keys.name for p in parts[start:] + parts[:start]]
        share = [n // k + (1 if i < n % k else 0) for i in range(k)]
        home = {m: self.q.partition(m).keys.name for m in self.score}
        got, full = [], []
        for name, want in zip(order, share):
            if want:
                part = self.pop_from(want, lambda m, name=name: home[m] == name)
                got += part
                if len(part) >= want:
                    full.append(name)
        for name in full + [name for name, want in zip(order, share) if not want]:
            if len(got) >= n:
                break
            got += self.pop_from(n - len(got), lambda m, name=name: home[m] == name)
        return got

    def pop_from(self, n, mine):
        got = []
        for m in sorted((m for m, s in self.score.items() if s <= self.now and mine(m)),
                        key=lambda m: (self.score[m], self.shard(m), m)):
            if len(got) == n:
                break
            prev = self.score[m]
            stalled = prev % 1 == 0.5
            if stalled and self.started.pop(m, None) == prev:
                self.suspect[m] = self.suspect.get(m, 0) + 1
                self.stalls[m] = self.stalls.get(m, 0) + 1
                # the last stall while checked alone
                if self.stalls[m] > self.max_stalled and self.suspect[m] > max(self.max_stalled, 2):
                    del self.score[m]
                    self.dead[m] = self.now
                    continue
            attempts = self.retries.get(m, 0) if prev % 1 == 0.25 else 0
            self.score[m] = self.now + self.lease + 0.5
            got.append((m, prev, stalled, attempts, self.suspect.get(m, 0) >= max(self.max_stalled, 2)))
        return got

    def clear_stalls(self, m):
        for d in (self.stalls, self.suspect, self.started):
            d.pop(m, None)

    def fence(self, lease):
        if lease.member not in self.score:
            return Refusal.GONE
        return 1 if self.score[lease.member] == float(lease.lease_score) else Refusal.LEASE_LOST

    def forget(self, m):
        for d in (self.score, self.ws, self.dead, self.stalls, self.retries, self.suspect, self.started):
            d.pop(m, None)

    def live(self, m):
        s = self.score.get(m)
        return s is not None and s % 1 == 0.5 and s > self.now

    def complete(self, lease, new_ws=None):
        m, prev = lease.member, float(lease.previous_score)
        self.score[m] = max(math.floor(prev), self.now) + self.interval
        self.clear_stalls(m)  # a completed cycle ends "in a row"
        self.retries.pop(m, None)


@pytest.mark.parametrize("steps", [QUICK_STEPS, pytest.param(STEPS, marks=pytest.mark.slow)])
def test_random_interleaving_matches_reference_model(make_queue, clock, steps):
    rnd = random.Random(20261129)
    interval, lease_ms, max_stalled = 5_000, 1_000, 2
    q = make_queue(interval_ms=interval, lease_ms=lease_ms, clock=clock, max_stalled=max_stalled)
    model = Model(q, clock.now, interval, lease_ms, max_stalled)
    held = []  # leases in the hands of simulated workers, some of them stale
    counts: dict[str, int] = {}
    outcomes: dict[tuple, int] = {}  # (operator call, 1 or refusal) -> times

    def seen(op, expect):
        outcomes[(op, expect)] = outcomes.get((op, expect), 0) + 1

    def fenced(lease, real_call, on_ok):
        expect = model.fence(lease)
        try:
            res = real_call()
            assert expect == 1, (lease, expect)
            on_ok(res)
            return res
        except LeaseLost:
            assert expect == Refusal.LEASE_LOST
        except QueueError as exc:
            if exc.code is Refusal.PAYLOAD_CHANGED:
                assert expect == 1
            else:
                assert (exc.code, expect) == (Refusal.GONE, Refusal.GONE)

    for step in range(steps):
        op = rnd.choices(
            ["import", "pop", "renew", "complete", "remove", "complete_payload", "retry", "tick", "enqueue",
             "pause", "reprocess", "update", "admin_remove", "drain", "obliterate", "respread", "enqueue_at"],
            weights=[6, 20, 6, 18, 3, 5, 3, 20, 3, 1, 2, 3, 2, 0.3, 0.3, 0.5, 2])[0]
        counts[op] = counts.get(op, 0) + 1
        if op == "import":
            members = rnd.sample(MEMBERS, rnd.randint(1, 6))
            w = rnd.randint(1, 4)
            assert q.schedule([(m, payload(m, {w})) for m in members]) == model.schedule(members, w), step
        elif op == "pop":
            n = rnd.randint(1, 5)
            got = q.pop(n)
            want = model.pop(n)
            assert [(le.member, float(le.previous_score), le.stalled, le.retry_attempts, le.alone)
                    for le in got] == want, (
                step, [(le.member, le.previous_score, le.shard) for le in got], [(m, model.shard(m)) for m, *_ in want])
            for le in got:
                assert float(le.lease_score) == model.score[le.member]
            started = [le for le in got if rnd.random() < 0.8]  # some leases never start
            q.mark_started(started)
            for le in started:
                model.started[le.member] = float(le.lease_score)
            held.extend(got)
        elif op == "tick":
            ms = rnd.choice([rnd.randint(0, 300), lease_ms + 1, rnd.randint(1000, interval)])
            clock.advance(ms)
            model.now = clock.now
        elif op == "pause":
            model.paused = not model.paused
            q.pause() if model.paused else q.resume()
        elif op == "enqueue":
            m = rnd.choice(MEMBERS)
            delay = rnd.randint(0, 2000)
            try:
                due = q.enqueue_in(m, delay)
                assert m in model.score and not model.live(m)
                model.score[m] = model.now + delay
                model.retries.pop(m, None)
                assert due == model.now + delay
            except QueueError as exc:
                expect = (Refusal.LEASED if model.live(m)
                          else Refusal.DEAD if m in model.dead else Refusal.GONE)
                assert exc.code is expect, step
        elif op == "enqueue_at":
            m = rnd.choice(MEMBERS)
            at = model.now + rnd.randint(-1000, 3000)
            try:
                due = q.enqueue_at(m, at)
                assert m in model.score and not model.live(m), step
                model.score[m] = at
                model.retries.pop(m, None)
                assert due == at
            except QueueError as exc:
                expect = (Refusal.LEASED if model.live(m)
                          else Refusal.DEAD if m in model.dead else Refusal.GONE)
                assert exc.code is expect, step
        elif op == "update":
            m = rnd.choice(MEMBERS)
            current = q.payload(m)
            base = current if rnd.random() < 0.6 or current is None else payload(m, {rnd.randint(1, 4)})
            new_ws = set(rnd.sample([1, 2, 3, 4], rnd.randint(1, 3)))
            force = rnd.random() < 0.5
            if m not in model.ws:
                expect = Refusal.GONE
            elif base != current:
                expect = Refusal.PAYLOAD_CHANGED
            elif model.live(m) and not force:
                expect = Refusal.ACTIVE_LEASES
            else:
                expect = 1
            seen(op, expect)
            try:
                q.update(m, payload(m, new_ws), base or payload(m, {1}), force=force)
                assert expect == 1, (step, expect)
                model.ws[m] = new_ws
            except QueueError as exc:
                assert exc.code is expect, step
        elif op == "admin_remove":
            m = rnd.choice(MEMBERS)
            current = q.payload(m)
            expected = rnd.choice([None, current, payload(m, {rnd.randint(1, 4)})])
            force = rnd.random() < 0.5
            if m not in model.ws:
                expect = Refusal.GONE
            elif expected is not None and expected != current:
                expect = Refusal.PAYLOAD_CHANGED
            elif model.live(m) and not force:
                expect = Refusal.ACTIVE_LEASES
            else:
                expect = 1
            seen(op, expect)
            try:
                q.remove_route(m, force=force, expected=expected)
                assert expect == 1, (step, expect)
                model.forget(m)
            except QueueError as exc:
                assert exc.code is expect, step
        elif op == "drain":
            res = q.drain(batch=rnd.choice([2, 7, 1000]))
            gone = [m for m in model.score if not model.live(m)]
            want = {"due": sum(1 for m in gone if model.score[m] <= model.now),
                    "waiting": sum(1 for m in gone if model.score[m] > model.now),
                    "leased_spared": sum(1 for m in model.score if model.live(m))}
            assert res == want, step
            for m in gone:
                model.forget(m)
        elif op == "obliterate":
            force = rnd.random() < 0.5
            if not model.paused:
                expect = Refusal.NOT_PAUSED
            elif any(model.live(m) for m in model.score) and not force:
                expect = Refusal.ACTIVE_LEASES
            else:
                expect = 1
            seen(op, expect)
            try:
                total = 0
                while True:
                    status, n = q.obliterate(force=force, batch=rnd.choice([3, 1000]))
                    total += n
                    if status == "done":
                        break
                assert expect == 1, step
                assert total == len(model.score) + len(model.dead), step
                for m in list(model.ws):
                    model.forget(m)
                model.paused = False
            except QueueError as exc:
                assert exc.code is expect, step
        elif op == "respread":
            res = q.respread(batch=rnd.choice([3, 1000]))
            leased = [m for m, sc in model.score.items() if sc % 1 == 0.5]
            moved = [m for m, sc in model.score.items() if sc % 1 != 0.5]
            assert (res["moved"], res["leased"]) == (len(moved), len(leased)), step
            for m in moved:
                s = float(q.score(m))
                assert s % 1 == 0 and model.now <= s < model.now + interval, (step, m, s)
                model.score[m] = s
        elif op == "reprocess":
            if model.dead:
                m = rnd.choice(sorted(model.dead))
                assert q.reprocess(m) == model.now
                del model.dead[m]
                model.clear_stalls(m)
                model.retries.pop(m, None)
                model.score[m] = model.now
        elif held:
            le = held.pop(rnd.randrange(len(held)))
            if op == "renew":
                def ok(res, le=le):
                    if model.started.get(le.member) == model.score[le.member]:  # a mark follows; none is made
                        model.started[le.member] = model.now + lease_ms + 0.5
                    model.score[le.member] = model.now + lease_ms + 0.5
                fenced(le, lambda: q.renew(le), ok)
            elif op == "complete":
                fenced(le, lambda: q.complete_one(le), lambda _r: model.complete(le))
            elif op == "retry":
                delay = rnd.randint(1, 3000)

                def ok(res, le=le, delay=delay):
                    model.score[le.member] = math.floor(model.now + delay) - 0.75
                    model.retries[le.member] = model.retries.get(le.member, 0) + 1
                    model.clear_stalls(le.member)
                    assert res == model.retries[le.member]
                fenced(le, lambda: q.retry(le, delay), ok)
            elif op == "remove":
                orig = set(Payload.decode(le.payload).workspaces)
                if model.fence(le) == 1 and orig != model.ws[le.member]:
                    with pytest.raises(QueueError, match="payload_changed"):
                        q.remove(le)
                else:
                    def ok(_r, le=le):
                        model.forget(le.member)
                    fenced(le, lambda: q.remove(le), ok)
            elif op == "complete_payload":
                orig = set(Payload.decode(le.payload).workspaces)
                want = set(orig)
                if rnd.random() < 0.5 and want:
                    want.discard(rnd.choice(sorted(want)))
                if rnd.random() < 0.5:
                    want.add(rnd.randint(1, 4))
                desired = payload(le.member, want)

                def ok(res, le=le, orig=orig, want=want):
                    cur = model.ws[le.member]
                    new = (cur - (orig - want)) | (want - orig)
                    if not new:
                        assert res == "removed"
                        model.forget(le.member)
                    else:
                        assert res == "completed"
                        model.ws[le.member] = new
                        model.complete(le, new_ws=new)
                fenced(le, lambda: q.complete_with_payload(le, desired), ok)
        if step % 25 == 0 or step == steps - 1:
            live = sum(1 for s in model.score.values() if s % 1 == 0.5 and s > model.now)
            expired = sum(1 for s in model.score.values() if s % 1 == 0.5 and s <= model.now)
            totals = q.status()["totals"]
            assert (totals["leased"], totals["expired_leases"]) == (live, expired), step
            for m in MEMBERS:
                s = q.score(m)
                assert (None if s is None else float(s)) == model.score.get(m), (step, m)
                p = q.payload(m)
                assert (None if p is None else set(Payload.decode(p).workspaces)) == model.ws.get(m), (step, m)
                info = q.inspect(m)
                assert info["stalls"] == model.stalls.get(m, 0), (step, m)
                assert (info["state"] == "dead") == (m in model.dead), (step, m)
    # the run exercised every operation, including stalls that dead-lettered routes (floors per 10,000 steps)
    often, rarely = 50 * steps // STEPS, 10 * steps // STEPS
    assert all(counts.get(op, 0) > often for op in ("pop", "complete", "renew", "retry", "remove", "import",
                                                    "update", "admin_remove", "enqueue_at")), counts
    assert all(counts.get(op, 0) > rarely for op in ("drain", "obliterate", "respread")), counts
    for op in ("update", "admin_remove"):  # every fence was met, and passed
        missing = [e for e in (1, Refusal.GONE, Refusal.PAYLOAD_CHANGED, Refusal.ACTIVE_LEASES)
                   if not outcomes.get((op, e), 0)]
        assert not missing, (op, missing, sorted(outcomes.items(), key=str))
    assert outcomes.get(("obliterate", 1), 0) > 0 and outcomes.get(("obliterate", Refusal.NOT_PAUSED), 0) > 0
    assert q.dead_letters() or counts["reprocess"] > 0
