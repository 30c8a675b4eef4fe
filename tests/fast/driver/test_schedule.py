"""When the driver saves, and whether colocated groups take turns on the devices (``miles.driver.schedule``)."""

from types import SimpleNamespace

from miles.driver.schedule import needs_sleep, should_save


def test_should_save_at_the_interval_and_the_last_rollout_only():
    def saves(interval, n, save="/ckpt"):
        return [
            r for r in range(n) if should_save(SimpleNamespace(save=save, save_interval=interval, num_rollout=n), r)
        ]

    assert saves(2, 5) == [1, 3, 4]
    assert saves(None, 4) == [3]
    assert saves(1, 3) == [0, 1, 2]
    assert saves(2, 5, save=None) == []


def test_groups_sleep_only_when_several_share_a_gpu():
    assert needs_sleep(2, use_gpu=True)
    assert not needs_sleep(1, use_gpu=True)  # a group alone on its GPU has nothing to free
    assert not needs_sleep(2, use_gpu=False)  # on the CPU nothing is moved (SleepController)
