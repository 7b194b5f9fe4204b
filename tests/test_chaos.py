"""The retry storm of tests/chaos.py, short (issue "Reliability: retry storms, crashes and
hostile input"): 22 s on shared data and 18 s on etcd, each with an Envoy SIGKILL and restart
in the middle, forward "detached", lease_ms 1000 (3000 with etcd, its minimum).

Asserts what chaos.py exits non-zero on: no unexplained duplicate effect, no lost or wrong
answer, no 5xx the plugin made or nobody explains, no unexpected refusal of an identical
request, no key left locked, no Wasm VM failure. The full runs: `python tests/chaos.py --store shared_data|etcd --duration 120`.
"""

import pytest

import chaos

RUNS = {"shared_data": 22.0, "etcd": 18.0}


@pytest.mark.parametrize("store", sorted(RUNS))
def test_short_storm_with_a_kill(wasm, store):
    result = chaos.run(store=store, duration=RUNS[store], clients=24, kill_at=RUNS[store] / 2,
                       log=print)
    print(result.report())
    assert result.restart_s is not None and result.kill_error is None, result.kill_error
    assert result.keys > 100 and result.successes > result.keys / 2, result.summary()
    assert not result.unexplained, "\n".join(result.details) or result.unexplained[:10]
    assert not result.lost, result.lost[:10]
    assert not result.plugin_5xx and not result.other_5xx, (result.plugin_5xx, result.other_5xx)
    assert not result.unexpected, result.unexpected_examples[:10]
    assert not result.stuck, result.stuck[:10]
    assert not result.vm_failures, result.vm_failures[:10]
    assert result.ok, result.summary()
