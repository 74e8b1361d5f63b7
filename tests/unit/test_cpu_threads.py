"""Which passes get every core on CPU, and which leave one to the event loop."""

import torch

from gpu_watchdog.inference.cpu_threads import PARALLEL_PREFILL_TOKENS, plan


def test_prefills_take_every_core_and_decode_steps_leave_one_to_the_event_loop() -> None:
    threads = plan(torch.device("cpu"), cores=4, env={})
    assert threads is not None
    assert threads.for_pass(32 * 256, prefill=True) == 4
    assert threads.for_pass(PARALLEL_PREFILL_TOKENS - 1, prefill=True) == 3
    assert threads.for_pass(32, prefill=False) == 3
    assert threads.for_pass(1, prefill=False) == 3


def test_one_core_is_never_left_with_no_thread() -> None:
    threads = plan(torch.device("cpu"), cores=1, env={})
    assert threads is not None and threads.for_pass(1, prefill=False) == 1


def test_an_explicit_omp_num_threads_wins_and_other_devices_are_left_alone() -> None:
    threads = plan(torch.device("cpu"), cores=2, env={"OMP_NUM_THREADS": "2"})
    assert threads is not None and threads.for_pass(1, prefill=False) == 2
    assert plan(torch.device("cuda"), cores=2, env={}) is None
