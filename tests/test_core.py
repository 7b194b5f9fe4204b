"""The behaviour contract (docs/behaviour.md §3) end to end, in both forwarding modes.

Each test runs against a fresh Envoy (so the plugin's counters are exact) and a fresh
effect-counting upstream (tests/upstream.py), and checks what clients saw against the number
of effects the upstream counted.
"""

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_util import (HOST, assert_in_progress, assert_replay_of, describe, is_in_progress,
                      is_replay, key_headers, new_key, plugin_counters, post, raw_exchange,
                      problem, retry_until_answer)
from harness import (EnvoyStartError, abandon, free_port, raw_request_bytes, request,
                     run_concurrently, wait_until)

BODY = b'{"amount":1}'


@pytest.fixture(scope="module", params=["router", "detached"])
def forward(request):
    return request.param


@pytest.fixture
def start(make_envoy, upstream, forward, wasm):
    """start(config=None, upstream_port=None, **envoy_kwargs) -> a fresh Envoy in this mode."""

    def start_envoy(config=None, upstream_port=None, **kwargs):
        plugin_config = {"forward": forward, **(config or {})}
        port = upstream.port if upstream_port is None else upstream_port
        return make_envoy(plugin_config, port, **kwargs)

    return start_envoy


def upstream_json(key, effect, method="POST", path="/payments", body=BODY):
    """The body tests/upstream.py answers for a write without x-body-bytes."""
    return {"key": key, "effect": effect, "method": method, "path": path,
            "body_sha256": hashlib.sha256(body).hexdigest()}


def assert_original(resp, key, effect, status=201):
    """An answer the upstream gave to this request (not a replay)."""
    assert resp.status == status, describe(resp)
    assert not is_replay(resp), describe(resp)
    assert resp.header_all("x-effect") == [str(effect)], describe(resp)
    assert resp.header_all("content-type") == ["application/json"], describe(resp)
    assert resp.json() == upstream_json(key, effect), describe(resp)


def classify_copies(responses, key):
    """Copies of one request: exactly one original 201 (effect 1); every other copy is the
    in-progress 409 or a replay of that original. Returns (original, n_409, n_replays)."""
    errors = [r for r in responses if isinstance(r, BaseException)]
    assert not errors, f"client errors for {key}: {errors[:3]}"
    originals = [r for r in responses if r.status == 201 and not is_replay(r)]
    assert len(originals) == 1, (key, [describe(r) for r in originals])
    first = originals[0]
    assert_original(first, key, 1)
    conflicts = replays = 0
    for r in responses:
        if r is first:
            continue
        if r.status == 409:
            assert_in_progress(r)
            conflicts += 1
        else:
            assert_replay_of(r, first)
            replays += 1
    return first, conflicts, replays


# --- 1. concurrency on one key ----------------------------------------------------------


@pytest.mark.every_envoy
def test_64_concurrent_copies_make_one_effect(upstream, start):
    envoy = start()
    key = new_key("burst")

    results = run_concurrently(
        lambda: post(envoy.port, key, extra={"x-delay-ms": "1500"}, timeout=30), 64,
        timeout=90, return_exceptions=True)

    first, conflicts, replays = classify_copies(results, key)
    print(f"64 copies: 1 original, {conflicts} x 409, {replays} replays")
    assert conflicts >= 1, "no copy met the first while it was in progress"
    assert upstream.effects() == {key: 1}
    counters = plugin_counters(envoy)
    assert counters["claimed"] == 1
    assert counters["conflict"] == conflicts
    assert counters["replayed"] == replays
    assert counters["completed"] == 1


# --- 2. replay ---------------------------------------------------------------------------


@pytest.mark.every_envoy
def test_retry_after_completion_is_replayed(upstream, start):
    envoy = start()
    key = new_key("replay")
    extra = {"x-set-cookie": "a=1,b=2"}

    first = post(envoy.port, key, extra=extra)
    retries = [post(envoy.port, key, extra=extra) for _ in range(2)]

    assert_original(first, key, 1)
    assert first.header_all("set-cookie") == ["a=1", "b=2"]
    for again in retries:
        assert_replay_of(again, first)
        assert again.header_all("set-cookie") == ["a=1", "b=2"]
        assert again.header_all("content-type") == ["application/json"]
        assert again.header_all("x-effect") == ["1"]
    assert upstream.effects() == {key: 1}
    counters = plugin_counters(envoy)
    assert (counters["claimed"], counters["completed"], counters["replayed"]) == (1, 1, 2)
    assert counters["entries_completed"] == 1 and counters["entries_in_progress"] == 0


# --- 3. an upstream failure releases the key ---------------------------------------------


@pytest.mark.every_envoy
def test_upstream_500_passes_through_and_releases_the_key(upstream, start):
    envoy = start()
    key = new_key("fail")

    failed = post(envoy.port, key, extra={"x-status": "500"})
    retry = post(envoy.port, key)
    again = post(envoy.port, key)

    assert_original(failed, key, 1, status=500)  # the upstream's own body passes
    assert_original(retry, key, 2)
    assert_replay_of(again, retry)
    assert upstream.effects() == {key: 2}
    counters = plugin_counters(envoy)
    assert (counters["claimed"], counters["released"], counters["completed"]) == (2, 1, 1)


@pytest.mark.parametrize("case", ["429", "404", "reset", "timeout"])
def test_release_statuses_and_missing_answers(upstream, start, forward, case):
    """429 (in release_statuses) and no answer (reset, timeout) release the key; 404 is an
    answer like any other: stored and replayed."""
    envoy = start({"upstream_timeout_ms": 1000}, route_timeout_s=1)
    key = new_key(case)
    extra = {"429": {"x-status": "429"}, "404": {"x-status": "404"},
             "reset": {"x-reset": "1"}, "timeout": {"x-delay-ms": "2500"}}[case]

    first = post(envoy.port, key, extra=extra)
    retry = post(envoy.port, key)

    if case == "404":
        assert_original(first, key, 1, status=404)
        assert_replay_of(retry, first)
        assert upstream.effects() == {key: 1}
        return
    if case == "429":
        assert_original(first, key, 1, status=429)
    elif forward == "router":  # Envoy's own answer passes through untouched
        assert first.header("idempotent-replayed") is None, describe(first)
        assert first.header_all("content-type") == ["text/plain"], describe(first)
        if case == "reset":
            assert first.status == 503, describe(first)
            assert first.body.startswith(b"upstream connect error or disconnect/reset"), \
                describe(first)
        else:
            assert (first.status, first.body) == (504, b"upstream request timeout"), \
                describe(first)
    else:
        problem(first, 502 if case == "reset" else 504, "upstream-failed", True)
    assert_original(retry, key, 2)
    assert upstream.effects() == {key: 2}
    counters = plugin_counters(envoy)
    assert (counters["claimed"], counters["released"], counters["completed"]) == (2, 1, 1)
    assert counters["upstream_failed"] == (0 if case == "429" else 1)


# --- 4. upstream down --------------------------------------------------------------------


def test_upstream_down_releases_the_key(upstream, start, forward):
    envoy = start(upstream_port=free_port())  # nothing listens there
    key = new_key("down")

    answers = [post(envoy.port, key) for _ in range(2)]

    for resp in answers:
        assert not is_in_progress(resp), describe(resp)
        if forward == "router":
            # Envoy's own 503 passes through untouched.
            assert resp.status == 503, describe(resp)
            assert resp.header("idempotent-replayed") is None
            assert resp.body.startswith(b"upstream connect error or disconnect/reset before "
                                        b"headers"), describe(resp)
        else:
            problem(resp, 503, "upstream-failed", True)
    assert upstream.effects() == {}
    counters = plugin_counters(envoy)
    assert (counters["claimed"], counters["released"], counters["upstream_failed"]) == (2, 2, 2)
    assert counters["conflict"] == 0
    assert counters["entries_in_progress"] == 0


# --- 5. client disconnect ----------------------------------------------------------------


def test_client_disconnect_router_expires_detached_completes(upstream, start, forward):
    lease_s = 1.0
    envoy = start({"lease_ms": int(lease_s * 1000)})
    key = new_key("gone")
    headers = key_headers(key, {"x-delay-ms": "3000"})

    t0 = time.monotonic()
    abandon(envoy.port, "POST", "/payments", headers, BODY, after_s=0.2)
    t_gone = time.monotonic()
    wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="the first call upstream")
    early = post(envoy.port, key)
    early_at = time.monotonic() - t0

    assert early_at < lease_s * 0.9, f"too slow to retry within the lease ({early_at:.2f}s)"
    assert_in_progress(early)
    if forward == "router":
        # The outcome is unknown: the mark is not renewed and expires after lease_ms.
        time.sleep(max(0.0, t_gone + 1.5 - time.monotonic()))
        retry = post(envoy.port, key)
        assert_original(retry, key, 2)
        assert upstream.effects() == {key: 2}
        # (Taken over by the retry, or freed by the sweep first: either way claimed anew.)
        assert plugin_counters(envoy)["claimed"] == 2
        # Envoy's router closed the first upstream call when the client left.
        wait_until(lambda: upstream.resets(key) == 1, timeout=8, message="the reset upstream")
        assert_replay_of(post(envoy.port, key), retry)
    else:
        # The upstream call goes on: 409 while it runs (beyond lease_ms: renewed), then the
        # stored answer.
        seen, final, _ = retry_loop(envoy.port, key)
        done_at = time.monotonic() - t0
        for resp in seen:
            assert_in_progress(resp)
        assert done_at >= 2.9, f"answered at {done_at:.2f}s, before the upstream could"
        assert final.status == 201 and is_replay(final), describe(final)
        assert final.json() == upstream_json(key, 1)
        assert final.header_all("x-effect") == ["1"]
        assert upstream.effects() == {key: 1}
        wait_until(lambda: answered(upstream, key), timeout=5, message="the upstream's log")
        assert upstream.resets(key) == 0
        counters = plugin_counters(envoy)
        assert counters["expired_takeover"] == 0 and counters["claimed"] == 1


def retry_loop(port, key, interval=0.25, timeout=15.0):
    return retry_until_answer(lambda: post(port, key), interval=interval, timeout=timeout)


def answered(upstream, key):
    return [e["outcome"] for e in upstream.log() if e["key"] == key] == ["answered"]


# --- 6. renewal --------------------------------------------------------------------------


def test_slow_upstream_keeps_its_mark_by_renewal(upstream, start):
    envoy = start({"lease_ms": 1000})  # the smallest lease the plugin accepts
    key = new_key("slow")
    extra = {"x-delay-ms": "3600"}  # over 3 leases

    with ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        pending = pool.submit(post, envoy.port, key, extra=extra, timeout=30)
        duplicates = []
        for at in (1.4, 2.6):  # after the first and the second lease would have ended
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            duplicates.append(post(envoy.port, key, extra=extra))
        first = pending.result(30)

    assert_original(first, key, 1)
    for dup in duplicates:
        assert_in_progress(dup)
    assert_replay_of(post(envoy.port, key), first)
    assert upstream.effects() == {key: 1}
    counters = plugin_counters(envoy)
    assert counters["expired_takeover"] == 0 and counters["conflict"] == 2


# --- 7. many keys, a few copies each ------------------------------------------------------


def test_1000_keys_4_concurrent_copies_each(upstream, start):
    envoy = start()
    keys = [new_key(f"m{i}") for i in range(1000)]
    groups, copies = 8, 4  # 32 threads: 8 groups of 4, each group sends one key's copies
    results = {k: [None] * copies for k in keys}

    def member(group, copy, barrier):
        for index in range(group, len(keys), groups):
            key = keys[index]
            try:
                barrier.wait(30)
            except threading.BrokenBarrierError:
                pass  # still send: a late copy is a copy
            try:
                results[key][copy] = post(envoy.port, key, timeout=30)
            except Exception as exc:  # noqa: BLE001 - checked below
                results[key][copy] = exc

    started = time.monotonic()
    threads = []
    for g in range(groups):
        barrier = threading.Barrier(copies)
        threads += [threading.Thread(target=member, args=(g, c, barrier), daemon=True)
                    for c in range(copies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, started + 180 - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "clients still running after 180 s"
    print(f"4000 requests in {time.monotonic() - started:.1f}s")

    totals = [0, 0]
    for key in keys:
        _, conflicts, replays = classify_copies(results[key], key)
        totals[0] += conflicts
        totals[1] += replays
    print(f"409s: {totals[0]}, replays: {totals[1]}")
    effects = upstream.effects()
    assert len(effects) == 1000
    assert effects == {k: 1 for k in keys}
    assert plugin_counters(envoy)["claimed"] == 1000


# --- 8. a burst of new keys right after start ---------------------------------------------


def test_cold_start_burst_200_keys_x_20_copies(upstream, start):
    keys = [new_key(f"cold{i}") for i in range(200)]  # before Envoy: the burst starts at once
    copies = 20
    envoy = start()

    started = time.monotonic()
    results = run_concurrently(
        lambda i: post(envoy.port, keys[i // copies], extra={"x-delay-ms": "100"}, timeout=30),
        len(keys) * copies, max_workers=64, timeout=180, return_exceptions=True)
    print(f"{len(results)} requests in {time.monotonic() - started:.1f}s")

    for n, key in enumerate(keys):
        classify_copies(results[n * copies:(n + 1) * copies], key)
    effects = upstream.effects()
    duplicated = {k: v for k, v in effects.items() if v != 1}
    assert not duplicated, f"{len(duplicated)} keys with more than one effect: {duplicated}"
    assert effects == {k: 1 for k in keys}
    assert plugin_counters(envoy)["claimed"] == 200


# --- 9. key churn through a small table ---------------------------------------------------


def churn(envoy, keys, rate, workers=16):
    """Sends one POST per key at `rate` per second; returns the answers, in key order."""
    lock = threading.Lock()
    cursor = iter(range(len(keys)))
    answers = [None] * len(keys)
    t0 = time.monotonic()

    def worker():
        while True:
            with lock:
                i = next(cursor, None)
            if i is None:
                return
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                answers[i] = post(envoy.port, keys[i], timeout=30)
            except OSError as exc:
                answers[i] = exc

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, t0 + len(keys) / rate + 60 - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "clients still running"
    return answers


def test_key_churn_through_a_small_table(upstream, make_envoy, wasm):
    """20,000 keys through a 1,024-entry table with 1 s retention (detached mode only): a
    warm-up pass of 8,000, then 12,000 more with Envoy's memory flat."""
    rate, capacity = 320.0, 1024  # live ≈ rate × retention ≈ 320 of 1,024
    envoy = make_envoy({"forward": "detached", "capacity": capacity, "retention_s": 1},
                       upstream.port)
    warm = [new_key(f"warm{i}") for i in range(8_000)]
    keys = [new_key(f"churn{i}") for i in range(12_000)]
    answers = churn(envoy, warm, rate)
    rss_warm = envoy.rss_bytes()
    answers += churn(envoy, keys, rate)
    counters = plugin_counters(envoy)  # just after the last answer: about 1 s of keys held
    rss_after = envoy.rss_bytes()
    held = counters["entries_completed"]
    # Every entry expires after 1 s and the sweep frees it: nothing stays held.
    wait_until(lambda: plugin_counters(envoy)["entries_completed"] == 0, timeout=5,
               message="expired entries swept")
    print(f"{len(answers)} keys at {rate:.0f}/s; held {held} completed entries at the end; "
          f"RSS after warm-up {rss_warm / 2**20:.1f} MiB, after 12,000 more "
          f"{rss_after / 2**20:.1f} MiB (+{(rss_after - rss_warm) / 2**20:.2f} MiB)")

    wrong = [(i, describe(r)) for i, r in enumerate(answers)
             if isinstance(r, BaseException) or r.status != 201 or is_replay(r)
             or r.header_all("x-effect") != ["1"]]
    assert not wrong, f"{len(wrong)} keys not answered by their own effect: {wrong[:5]}"
    effects = upstream.effects()
    assert len(effects) == len(answers) and set(effects.values()) == {1}
    assert counters["claimed"] == len(answers)
    assert counters["store_full"] == 0 and counters["evicted"] == 0, counters
    assert counters["entries_in_progress"] == 0
    # About rate × retention are held; twice that is the bound.
    assert 0 < held <= 2 * rate * 1, held
    # A leak of 256 bytes per key would be 3 MiB here.
    assert rss_after - rss_warm < 2 * 2**20


# --- 10. what is not covered, malformed keys, configuration -------------------------------


def test_get_put_and_keyless_post_pass_through(upstream, start):
    envoy = start()
    key = new_key("pass")

    gets = [request(envoy.port, "GET", "/payments", {"Idempotency-Key": key}) for _ in range(2)]
    puts = [post(envoy.port, key, method="PUT") for _ in range(2)]
    keyless = [post(envoy.port, None) for _ in range(2)]

    for resp in gets:
        assert resp.status == 200 and not is_replay(resp), describe(resp)
        assert resp.json() == {"key": key, "effect": 0, "method": "GET", "path": "/payments",
                               "body_sha256": hashlib.sha256(b"").hexdigest()}
    for n, resp in enumerate(puts, 1):
        assert resp.status == 201 and not is_replay(resp), describe(resp)
        assert resp.json() == upstream_json(key, n, method="PUT")
    for n, resp in enumerate(keyless, 1):
        assert_original(resp, "", n)
    assert upstream.effects() == {key: 2, "": 2}
    counters = plugin_counters(envoy)
    assert counters["claimed"] == 0 and counters["missing_key"] == 0


MALFORMED_KEYS = {
    "space": "a b",
    "too_long": "k" * 300,
    "unterminated": '"unterminated',
    "bad_escape": '"bad\\escape"',
    "after_quote": '"abc"x',
    "empty_quoted": '""',
}


@pytest.mark.parametrize("name", sorted(MALFORMED_KEYS))
def test_malformed_key_gets_400(upstream, start, name):
    envoy = start()
    resp = post(envoy.port, MALFORMED_KEYS[name])
    problem(resp, 400, "invalid-key", False)
    assert upstream.effects() == {}
    assert plugin_counters(envoy)["invalid_key"] == 1


def test_malformed_keys_on_the_wire_get_400(upstream, start):
    """Keys http.client would not send as they are: non-ASCII bytes, an empty value, a
    control character, the header twice."""
    envoy = start()
    key = new_key("twice")
    cases = {
        "utf8": [("Idempotency-Key", "caf\u00c3\u00a9")],  # the UTF-8 bytes of "café"
        "latin1": [("Idempotency-Key", "caf\u00e9")],
        "empty": [("Idempotency-Key", "")],
        "twice": [("Idempotency-Key", key), ("Idempotency-Key", key)],
        "twice_other_case": [("Idempotency-Key", key), ("idempotency-key", key + "x")],
    }
    answers = {}
    for name, key_values in cases.items():
        headers = [("Host", HOST), ("content-type", "application/json"), *key_values,
                   ("Connection", "close")]
        answers[name] = raw_exchange(envoy.port,
                                     raw_request_bytes("POST", "/payments", headers, BODY))

    for name, resp in answers.items():
        assert resp.status == 400, (name, describe(resp))
        problem(resp, 400, "invalid-key", False)
    assert upstream.effects() == {}
    assert plugin_counters(envoy)["invalid_key"] == len(cases)


def test_require_key_refuses_a_keyless_post(upstream, start):
    envoy = start({"require_key": True})

    missing = post(envoy.port, None)
    get = request(envoy.port, "GET", "/payments")
    keyed = post(envoy.port, new_key("req"))

    problem(missing, 400, "missing-key", False)
    assert get.status == 200  # not a covered method
    assert keyed.status == 201
    assert len(upstream.effects()) == 1
    assert plugin_counters(envoy)["missing_key"] == 1


@pytest.mark.parametrize("config, field", [({"lease_ms": "soon"}, "lease_ms"),
                                           ({"bogus": 1}, "bogus"),
                                           ({"lease_ms": 50}, "lease_ms"),
                                           ({"forward": "sideways"}, "forward")])
def test_malformed_config_is_refused(upstream, make_envoy, wasm, forward, config, field):
    plugin_config = {"forward": forward, **config}
    with pytest.raises(EnvoyStartError) as failure:
        make_envoy(plugin_config, upstream.port)
    assert f"invalid configuration: field `{field}`" in failure.value.log


def test_quoted_bare_and_chunked_are_the_same_request(upstream, start):
    envoy = start()
    key = new_key("q")

    quoted = post(envoy.port, f'"{key}"')
    bare = post(envoy.port, key)
    # The same request again, its body framed in chunks: the same fingerprint.
    chunked = request(envoy.port, "POST", "/payments", key_headers(key),
                      [BODY[:5], BODY[5:]])

    assert quoted.status == 201 and not is_replay(quoted), describe(quoted)
    assert_replay_of(bare, quoted)
    assert_replay_of(chunked, quoted)
    assert upstream.effects() == {f'"{key}"': 1}  # the upstream sees the raw header
