"""The sidecar's behavioural constants: every interval, wait, retry and bound of time the rules and
the loop use that is not a setting, in one place, each with why it is what it is."""

from __future__ import annotations

from gpu_watchdog.watchdog.core.names import FLEET_BREAKER_OPEN, FLEET_LEDGER_UNKNOWN, FLEET_UNAVAILABLE_LIMIT

# -- The loop ----------------------------------------------------------------------------------------

TICK_S = 0.5  # the loop's evaluation interval: a failed scrape is tried again this soon
LAG_PROBE_S = 0.25  # how often the loop measures its own lateness
LAG_FOLD_S = 5.0  # and how often the figures are folded (what `/status` shows)
BUDGET_READ_S = 60.0  # the workload's restart Events are read again this often (and before a restart)
# The workload's quarantine is read from its Lease and pushed to our server this often: a request
# quarantined by another replica is refused here within it.
QUARANTINE_SYNC_S = 5.0
WORKLOAD_TRIES = 3  # reads of our own pod at start (1 s, then 2 s apart) before the name stands in

# -- A restart ---------------------------------------------------------------------------------------

# Failed exits of one worker process (its control API timed out or answered nothing usable; not
# "gone already") before its restart falls back to the container's rung. Two: one exit that times
# out may be a control loop slow for a moment (a long pause, a flood of requests), and the next try
# comes only after the failure's backoff (30 s); a second is a process wedged past its control API,
# which only a new container frees, and every further try would leave it a zombie on its GPU for
# another, doubled, backoff.
EXIT_TRIES = 2
# A restart asked again while the fleet holds it (every 2 s) reads the workload's Events again only
# once they are this old.
BUDGET_FRESH_S = 10.0
# After a restart that failed, the same restart is decided again no sooner than this (doubling).
RESTART_RETRY_S, RESTART_RETRY_MAX_S = 30.0, 900.0
# A restart the workload's ledger held is asked again after this: soon for a slot (the next one that
# frees is taken), rarely while the breaker is open (only an operator or a quiet window closes it).
FLEET_RETRY_S = {FLEET_UNAVAILABLE_LIMIT: 2.0, FLEET_LEDGER_UNKNOWN: 10.0, FLEET_BREAKER_OPEN: 30.0}
# The server lifts a drain by itself this long after `drain_timeout`, should we never say more
# (a sidecar killed mid-restart): an accepted eviction replaces the pod well before.
DRAIN_DEADLINE_MARGIN_S = 120.0
# How long a restart waits for its failure's record (the Lease written) before it goes on beside it.
RECORD_WAIT_S = 5.0
# A failure whose record could not be written is tried again this long after, not at every
# evaluation (a restart the budget blocks is decided again at each one).
RECORD_RETRY_S = 30.0
# A stopping sidecar says what its server answered within this (a pod's grace period is 30 s by default).
LEAVING_WAIT_S = 3.0

# -- What the edges said -----------------------------------------------------------------------------

# The kubelet is asked again this long after its first refusal, doubled at each one, up to the bound.
POD_GPUS_RETRY_S, POD_GPUS_RETRY_MAX_S = 5.0, 300.0
# The Node's escalation is looked at again this long after an edge refused it, doubled up to the bound.
ESCALATION_RETRY_S, ESCALATION_RETRY_MAX_S = 30.0, 3600.0
# `restart_not_recorded` is said while the last attempt's Event was refused and a restart is still
# wanted: a wanted one is tried again within the longest backoff (15 min), so after twice that
# without an attempt the restart is no longer wanted and the episode is over.
NOT_RECORDED_HOLD_S = 1800.0

# -- The fleet's ledger, and every record another node's clock dated ---------------------------------

HELD_NOTE_EVERY_S = 60.0  # a sidecar held by an open breaker says so in the ledger this often at most
# The API server stamps a pod's creation (in whole seconds), a node's clock stamps a slot (clocks of
# one cluster agree within NTP's error, CLOCK_SKEW_S). A sidecar that took a slot waits SLOT_WAIT_S
# before it replaces its pod, so that its replacement's creation is stamped after the slot by either
# clock: a pod stamped at or before a slot never replaced it (a scale-up's pod created just before
# would otherwise pass for the replacement). A slot of a ledger written before that wait (no
# template kept) still counts a pod created CLOCK_SKEW_S before it.
CLOCK_SKEW_S = 2.0
SLOT_WAIT_S = CLOCK_SKEW_S + 1.5
# The API server stamps a pod's creation in whole seconds (rounded down).
CREATED_ROUNDING_S = 1.0
# Entries dated further ahead than this are not believed (a node's clock far off, or a forged
# annotation): they would hold a slot or the breaker until they expired.
FUTURE_S = 60.0

# A read or write of the Lease the API server did not answer (a timeout, a 5xx, a 429) is tried this
# many times in all, API_RETRY_S apart and more, within the one call: a flaky API must not leave a
# success unrecorded until the next sync (a write whose answer was lost is safe to try again: its
# compare-and-swap then answers 409, and the change is decided again on what was written).
API_TRIES = 3
API_RETRY_S = 0.2

# -- Placement ---------------------------------------------------------------------------------------

LIFT_SYNC_S = 60.0  # expired taints are looked for this often (a TTL is hours), or at a tenth of a shorter one
# Lifts this recent are checked to be gone from the cluster at each reconcile: a sidecar that read the
# records before a lift may have put the taint back, and nothing else would take it away.
LIFT_SWEEP_S = 600.0
