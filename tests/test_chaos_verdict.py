"""The retry storm's verdict (tests/chaos.py) on made-up runs: what it excuses and what it
does not. No Envoy: a Storm whose run is replaced by a log of effects and answers."""

import chaos


class FakeWatcher:
    """What chaos.EtcdWatcher records: per etcd key, (t, kind, mod_revision, state, gen,
    deadline)."""

    def __init__(self, events):
        self.events = events

    def history(self, name):
        return list(self.events.get(name, []))


def effect(key, n, t, t_answer, status=201, outcome="answered"):
    return {"key": key, "effect": n, "status": status, "t": t, "t_answer": t_answer,
            "method": "POST", "path": "/payments", "outcome": outcome}


def storm(store, t_kill, watcher=None):
    s = chaos.Storm(store=store, duration=10, clients=1, log=lambda *a: None)
    s.t_kill = t_kill
    s.watcher = watcher
    return s


def test_etcd_excuses_a_duplicate_after_the_kill_only_if_the_completion_was_never_written():
    key = "k1"
    first = effect(key, 1, t=100.0, t_answer=100.5)  # answered 1.5 s before the kill
    again = effect(key, 2, t=103.0, t_answer=103.1)  # after the restart
    written = FakeWatcher({chaos.etcd_key(key): [
        (100.0, "PUT", 5, "in_progress", 1, 0), (100.51, "PUT", 6, "completed", 1, 0)]})
    not_written = FakeWatcher({chaos.etcd_key(key): [(100.0, "PUT", 5, "in_progress", 1, 0)]})

    verdict = storm("etcd", 102.0, written).explain([first, again], 1, [])
    assert verdict.startswith("UNEXPLAINED"), verdict  # etcd kept it: the replay was owed
    assert storm("etcd", 102.0, not_written).explain([first, again], 1, []) == "kill"
    # Shared data: the store died with the process, so any earlier success is excused.
    assert storm("shared_data", 102.0).explain([first, again], 1, []) == "kill"


def test_a_plugin_5xx_fails_the_run():
    s = storm("shared_data", None)
    result = chaos.Result(store="shared_data", forward="detached", duration=1, clients=1,
                          seed=0)
    answer = chaos.Attempt(key="k", client=0, phase="storm", t0=0.0)
    answer.status, answer.problem = 503, "store-unavailable"
    s.check_answer(answer, [], result)
    assert result.plugin_5xx and not result.ok, result.summary()
