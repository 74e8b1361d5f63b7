"""The documentation's pictures, as SVG written from this file: docs/pictures/*.svg.

    python tools/pictures.py          # write them
    python tools/pictures.py --check  # exit 1 naming each file that differs from what would be written

Standard library only, and deterministic: the same bytes on every run, so a test can compare the
committed files with `render()`. Every fact drawn here is the code's (gpu_watchdog/contract.py,
watchdog/core/settings.py, watchdog/core/policy.py, watchdog/runtime/app.py, watchdog/edge/executor.py,
watchdog/edge/effects/restart.py): change the code, change the picture.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
SIZE = 13  # body text; titles 14, notes 12: readable with the picture shown about 800 px wide
LINE = 18  # the distance between two lines of a box

INK = "#1f2933"
MUTED = "#52606d"
WHITE = "#ffffff"

# One palette for all three pictures: (fill, stroke) by what a part is.
INFERENCE = ("#e8f0fe", "#1a5fb4")
WATCHDOG = ("#e6f4ea", "#1e7b34")
CLUSTER = ("#fff4e0", "#a65e00")
GPU = ("#f1e8fb", "#6f3fb0")
HOLD = ("#fdecea", "#b3261e")
NEUTRAL = ("#f4f5f7", "#7b8794")

DOT = "\u00b7"  # a middle dot between names
GE = "\u2265"
TIMES = "\u00d7"
APPROX = "\u2248"


def esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def num(v: float) -> str:
    """A coordinate, written the same way on every run."""
    return f"{round(v, 2):g}"


# A line of text in a box: plain, or (text, style) with style "b" bold, "m" muted, "s" small muted.
Line = str | tuple[str, str]


@dataclass(frozen=True)
class Style:
    size: int
    weight: str
    fill: str


STYLES = {
    "": Style(SIZE, "normal", INK),
    "b": Style(14, "bold", INK),
    "m": Style(SIZE, "normal", MUTED),
    "s": Style(12, "normal", MUTED),
}


def split(line: Line) -> tuple[str, Style]:
    return (line, STYLES[""]) if isinstance(line, str) else (line[0], STYLES[line[1]])


class Svg:
    """One picture: parts appended in drawing order, written with a white background."""

    def __init__(self, name: str, width: int, height: int, title: str, desc: str) -> None:
        self.name = name
        self.width = width
        self.height = height
        self.title = title
        self.desc = desc
        self.parts: list[str] = []
        self.markers: dict[str, str] = {}

    def marker(self, color: str) -> str:
        """The id of an arrowhead in `color` (one definition per color used)."""
        mid = f"head-{color.lstrip('#')}"
        self.markers[mid] = (
            f'<marker id="{mid}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{color}"/></marker>')
        return mid

    def text(self, x: float, y: float, text: str, style: Style = STYLES[""], anchor: str = "start",
             fill: str | None = None) -> None:
        weight = ' font-weight="bold"' if style.weight == "bold" else ""
        self.parts.append(f'<text x="{num(x)}" y="{num(y)}" font-size="{style.size}"{weight} '
                          f'fill="{fill or style.fill}" text-anchor="{anchor}">{esc(text)}</text>')

    def lines(self, x: float, top: float, lines: Sequence[Line], anchor: str = "middle",
              fill: str | None = None, step: float = LINE) -> None:
        """Lines of text, the first baseline a line's ascent below `top`."""
        for i, line in enumerate(lines):
            text, style = split(line)
            self.text(x, top + i * step + 0.78 * step, text, style, anchor, fill)

    def rect(self, x: float, y: float, w: float, h: float, colors: tuple[str, str], dashed: bool = False,
             rx: float = 6, width: float = 1.5) -> None:
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        self.parts.append(f'<rect x="{num(x)}" y="{num(y)}" width="{num(w)}" height="{num(h)}" rx="{num(rx)}" '
                          f'fill="{colors[0]}" stroke="{colors[1]}" stroke-width="{num(width)}"{dash}/>')

    def box(self, x: float, y: float, w: float, h: float, lines: Sequence[Line], colors: tuple[str, str],
            dashed: bool = False, anchor: str = "middle", pad: float = 12) -> None:
        """A box with its lines centred in it (vertically; horizontally too unless `anchor` is start)."""
        self.rect(x, y, w, h, colors, dashed)
        tx = x + w / 2 if anchor == "middle" else x + pad
        self.lines(tx, y + (h - len(lines) * LINE) / 2, lines, anchor)

    def arrow(self, points: Sequence[tuple[float, float]], color: str = INK, dashed: bool = False,
              label: Sequence[Line] = (), at: tuple[float, float] = (0, 0), anchor: str = "middle",
              both: bool = False) -> None:
        """A line through `points` with a head at its end (and its start with `both`), its label's
        lines starting at `at`."""
        head = self.marker(color)
        d = " ".join(("M" if i == 0 else "L") + f"{num(px)},{num(py)}" for i, (px, py) in enumerate(points))
        dash = ' stroke-dasharray="5 4"' if dashed else ""
        start = f' marker-start="url(#{head})"' if both else ""
        self.parts.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="1.6"{dash}{start} '
                          f'marker-end="url(#{head})"/>')
        if label:
            self.lines(at[0], at[1], label, anchor, step=16)

    def group(self, parts: Iterable[str], opacity: float) -> None:
        self.parts.append(f'<g opacity="{num(opacity)}">')
        self.parts.extend(parts)
        self.parts.append("</g>")

    def render(self) -> str:
        head = [
            '<?xml version="1.0" encoding="UTF-8"?>',
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
            f'viewBox="0 0 {self.width} {self.height}" role="img" aria-labelledby="{self.name}-title '
            f'{self.name}-desc" font-family="{FONT}">',
            f'<title id="{self.name}-title">{esc(self.title)}</title>',
            f'<desc id="{self.name}-desc">{esc(self.desc)}</desc>',
            "<defs>", *(self.markers[k] for k in sorted(self.markers)), "</defs>",
            f'<rect x="0" y="0" width="{self.width}" height="{self.height}" fill="{WHITE}"/>',
        ]
        return "\n".join([*head, *self.parts, "</svg>"]) + "\n"


# -- the pod -------------------------------------------------------------------------------------

def pod() -> Svg:
    svg = Svg("pod", 800, 557, "One pod: the inference container and the watchdog sidecar",
              "Clients call the inference container's public API on port 8000 (/v1/completions, "
              "/v1/chat/completions, /metrics, /readyz). Its control API listens on 127.0.0.1:8001 behind a "
              "bearer token (canary, memory, empty_cache, drain, admission, quarantine). The watchdog sidecar "
              "serves /metrics, /status and /readyz on port 9402; Prometheus scrapes it and the server's "
              "/metrics on 8000. The sidecar drives the control API (canary, memory, empty_cache, drain), "
              "reads the GPU through NVML, and calls the Kubernetes API (Eviction, Events, Pods) and the "
              "workload's Lease, the fleet ledger (slots, breaker, quarantine) that every replica shares.")
    # The pod, and in it the two containers.
    svg.rect(250, 20, 328, 422, NEUTRAL, dashed=True, rx=10)
    svg.text(264, 42, "Pod (one replica)", STYLES["b"], fill=MUTED)
    svg.box(266, 56, 296, 86, [("watchdog sidecar", "b"), ":9402", f"GET /metrics {DOT} /status {DOT} /readyz"],
            WATCHDOG)
    svg.rect(266, 194, 254, 230, INFERENCE)
    svg.text(318, 216, "inference container", STYLES["b"])
    svg.box(278, 228, 230, 88, [("control API  127.0.0.1:8001", "b"), "bearer token",
                                f"canary {DOT} memory {DOT} empty_cache", f"drain {DOT} admission {DOT} quarantine"],
            (WHITE, INFERENCE[1]))
    svg.lines(393, 324, [(":8000  public API", "b"), "POST /v1/completions", "POST /v1/chat/completions",
                         f"GET /metrics {DOT} /readyz"])
    # The GPU, below the pod: the model's through CUDA, the sidecar's to read through NVML.
    svg.box(266, 487, 296, 52, [("GPU", "b"), ("on the node, given to this pod", "s")], GPU)
    svg.arrow([(393, 424), (393, 485)], GPU[1], label=["CUDA"], at=(401, 446), anchor="start")
    svg.arrow([(542, 142), (542, 485)], GPU[1], label=["NVML"], at=(500, 446), anchor="start")
    # The sidecar drives the control API.
    svg.arrow([(298, 142), (298, 226)], WATCHDOG[1], label=[f"canary {DOT} memory {DOT}", f"empty_cache {DOT} drain"],
              at=(308, 152), anchor="start")
    # Outside, on the left: who calls the pod.
    svg.box(20, 54, 120, 60, [("Prometheus", "b"), ("scrapes both", "s")], NEUTRAL)
    svg.arrow([(140, 74), (264, 74)], INK, label=[":9402/metrics"], at=(198, 54))
    svg.arrow([(140, 98), (196, 98), (196, 344), (264, 344)], INK, label=[":8000/metrics"], at=(188, 204),
              anchor="end")
    svg.box(20, 370, 120, 52, [("Clients", "b"), ("via the Service", "s")], NEUTRAL)
    svg.arrow([(140, 396), (264, 396)], INK, label=["HTTP :8000"], at=(202, 376))
    # Outside, on the right: the cluster the sidecar writes to.
    svg.box(606, 36, 184, 134, [("Kubernetes API", "b"), "Eviction: its own pod", "Events: restart records",
                                ("(the restart budget)", "m"), "Pods: its own", "Deployment: replicas"], CLUSTER)
    svg.arrow([(562, 92), (604, 92)], CLUSTER[1])
    svg.box(606, 214, 184, 112, [("Lease", "b"), ("<release>-fleet", "s"), "the fleet ledger:",
                                 f"slots {DOT} breaker", "quarantine"], CLUSTER)
    svg.arrow([(562, 128), (590, 128), (590, 270), (604, 270)], CLUSTER[1])
    # The other replicas share the Lease.
    ghosts = Svg("ghost", 0, 0, "", "")
    for x, name in ((606, "replica 2"), (704, "replica 3")):
        ghosts.box(x, 378, 86, 52, [(name, "b"), ("watchdog", "s")], NEUTRAL, dashed=True)
        ghosts.arrow([(x + 43, 376), (x + 43, 328)], CLUSTER[1], dashed=True)
    svg.group(ghosts.parts, 0.55)
    svg.markers.update(ghosts.markers)
    svg.text(698, 452, "every replica shares", STYLES["s"], "middle")
    svg.text(698, 468, "one Lease", STYLES["s"], "middle")
    return svg


# -- the remedy ladder -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Rung:
    title: str
    does: tuple[str, ...]
    when: tuple[str, ...]
    colors: tuple[str, str]


RUNGS = (
    Rung("Empty the CUDA cache", ("POST /control/empty_cache",),
         (f"when: memory pressure (reserved {GE} 85 % of the card),",
          "an OOM, or fragmentation drift (at most 3 flushes",
          "in one drift episode)"), WATCHDOG),
    Rung("Lower the admission limit",
         ("POST /control/admission: the rows on the card halve;",
          "one slot back after a quiet 5 min in full use"),
         ("when: OOMs a flush did not stop (2 within 60 s);", "never a restart, the budget untouched"), WATCHDOG),
    Rung("Restart in place",
         ("a worker: POST /control/exit (target.workers > 1)",
          "the container: the verdict file its liveness probe",
          "reads (restart.strategy container)"),
         ("when: hang, context_loss, unservable, startup_timeout,",
          "fragmentation drift after 3 flushes, max_age"), CLUSTER),
    Rung("Restart the pod",
         ("Eviction API: a dry run first, drained (not for hang",
          "or context_loss), budgeted, PDB-respecting"),
         ("when: the GPU lost or unhealthy, or the driver says",
          "reset or reboot; 2 in-place restarts for one reason",
          "in 1 h that did not cure; with restart.strategy evict",
          "or delete, every restart"), CLUSTER),
    Rung("GPU suspect: the Node is told",
         ("a Warning Event GPUSuspect; opt-in, the Node condition",
          "GPUSuspect=True; never a taint, a cordon or a drain"),
         ("when: the same GPU restarted for context_loss or hang",
          "2 times in 24 h, or the driver says reset or reboot"), GPU),
)

HOLDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("restart budget", ("3 per lineage; the workload's", "max(3, replicas), per 1 h;", "counted from the Events")),
    ("fleet ledger (the Lease)", ("max_unavailable (25 %) at once;", "the breaker: a fault the fleet",
                                  "shares stops them fleet-wide")),
    ("PodDisruptionBudget (PDB)", ("an eviction's 429: wait, retry;", "the pod serves on, ready")),
    ("startup_timeout", ("nothing restarts a target that", "has not served yet, for 30 min")),
    ("restart.strategy none", ("decided and reported, not done",)),
    ("the restart Event refused", ("no record, no restart",)),
)


def ladder() -> Svg:
    top, gap, pad, x, w = 46, 26, 10, 20, 462
    heights = [pad * 2 + LINE * (1 + len(r.does) + len(r.when)) for r in RUNGS]
    tops = [top + sum(heights[:i]) + gap * i for i in range(len(RUNGS))]
    height = tops[-1] + heights[-1] + 24
    svg = Svg("ladder", 800, height, "The remedy ladder: the cheapest cure first",
              "Five rungs, cheapest first. 1: empty the CUDA cache on memory pressure, an OOM or fragmentation "
              "drift. 2: lower the admission limit when OOMs keep coming after a flush. 3: restart in place, a "
              "worker through POST /control/exit or the container through the verdict file with "
              "restart.strategy container. 4: restart the pod through the Eviction API, drained, budgeted and "
              "PodDisruptionBudget-respecting. 5: report a GPU suspect on its Node with an Event and an opt-in "
              "Node condition, never a taint. Beside the restart rungs, what holds a restart back: the restart "
              "budget, the fleet ledger's max_unavailable and breaker, the PodDisruptionBudget, startup_timeout, "
              "restart.strategy none, and a restart Event the API refuses.")
    svg.text(x, 28, "Cheapest first", STYLES["b"])
    svg.text(x + 122, 28, "(each rung: what it does, and what calls for it)", STYLES["s"])
    for i, (rung, y, h) in enumerate(zip(RUNGS, tops, heights, strict=True)):
        svg.rect(x, y, w, h, rung.colors)
        svg.parts.append(f'<circle cx="{x + 24}" cy="{y + 24}" r="13" fill="{rung.colors[1]}"/>')
        svg.text(x + 24, y + 29, str(i + 1), Style(14, "bold", WHITE), "middle")
        svg.lines(x + 50, y + pad, [(rung.title, "b"), *rung.does, *((t, "m") for t in rung.when)], "start")
        if i + 1 < len(RUNGS):
            svg.arrow([(x + 24, y + h), (x + 24, tops[i + 1] - 1)], MUTED)
    # What holds the restart rungs back, beside them.
    first, last = tops[2], tops[3] + heights[3]
    bx = x + w + 12
    mid = (first + last) / 2
    svg.parts.append(f'<path d="M{bx},{first} h8 V{last} h-8" fill="none" stroke="{HOLD[1]}" stroke-width="1.6"/>')
    svg.arrow([(bx + 8, mid), (bx + 26, mid)], HOLD[1])
    step, group_gap = 17, 8
    panel_h = 16 + step + sum(group_gap + step * (1 + len(says)) for _, says in HOLDS)
    px, py = bx + 28, mid - panel_h / 2
    svg.rect(px, py, 800 - px - 12, panel_h, HOLD)
    svg.lines(px + 12, py + 8, [("What holds a restart back", "b")], "start", step=step)
    at = py + 8 + step
    for name, says in HOLDS:
        at += group_gap
        svg.lines(px + 12, at, [(name, "b"), *says], "start", step=step)
        at += step * (1 + len(says))
    return svg


# -- one restart's timeline ------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    title: str
    detail: tuple[str, ...]
    colors: tuple[str, str]
    hold: tuple[str, ...] = ()  # how this step can hold the restart, if it can
    note: tuple[str, ...] = ()  # or a note where it cannot
    skipped: bool = False  # not done for this restart


STEPS = (
    Step("3 canary timeouts in a row", ("POST /control/canary, canary.timeout (10 s) each;",
                                       "after a timeout the next canary starts at once;",
                                       "the server's generated-token counter flat across them"), WATCHDOG,
         note=("the counter advancing: saturated,", "ready, no restart")),
    Step("decision: hang", ("no drain: a hung kernel never finishes;",
                            "the rung: the pod, with restart.strategy evict"), WATCHDOG),
    Step("take the stacks of every thread", ("POST /control/stacks: where it is stuck, kept in",
                                              "the termination log and the flight recording"), INFERENCE,
         note=("never holds the restart",)),
    Step("record what was in flight (query of death)",
         ("GET /control/requests; the failure added to the Lease's", "records, waited for 5 s at most"),
         INFERENCE, note=("never holds the restart",)),
    Step("read the restart budget again", ("the workload's restart Events: 3 per lineage,",
                                           "max(3, replicas) for the workload, per 1 h"), CLUSTER,
         hold=("spent or unreadable: no restart,", "reported (blocked_by_budget)")),
    Step("take a slot in the Lease", ("at most max_unavailable (25 %) restarting at once,",
                                      "written with resourceVersion: never two for the last"), CLUSTER,
         hold=("no slot: held, asked again in 2 s;", "breaker open, ledger unknown: held")),
    Step("count the workload again, 3.5 s on", ("its pods listed right before it goes: a drain or",
                                                "a scale-down since the slot was granted counts"), CLUSTER,
         hold=("too many out now: the slot back,", "held, asked again in 2 s")),
    Step("ask: a dry-run eviction", ("the API server answers from the PodDisruptionBudget",), CLUSTER,
         hold=("429: nothing drained, the pod", "serves on; retried with backoff")),
    Step("write the restart Event (Warning Hang)", ("on the pod: reason, workload, node, GPUs,",
                                                    "the fingerprints that were in flight"), CLUSTER,
         hold=("refused (403, quota, 3 tries):", "nothing done, restart_not_recorded")),
    Step("drain: none for hang (nor for context_loss)",
         ("other reasons: POST /control/drain, at most", "restart.drain_timeout (30 s)"), INFERENCE,
         skipped=True),
    Step("evict: the policy/v1 Eviction", ("the old pod stays unready until it has gone;",
                                           "a refusal now lifts any drain, and it is retried"), CLUSTER),
    Step("the replacement pod starts", ("starting: nothing restarts it before",
                                        "policy.startup_timeout (30 min)"), GPU),
    Step("its first canary serves", ("ready again: the Service routes to it",), GPU),
    Step("the slot given back", ("by the replacement's sidecar (fleet_replica_back);",
                                 "after policy.fleet.slot_timeout (30 min) in any case"), CLUSTER),
)

# The phases of the axis: (first step, last step, what, how long).
PHASES = ((0, 1, "evidence", f"{APPROX} 60 s"), (2, 10, "the restart", "seconds"), (11, 13, "the new pod", "minutes"))


def timeline() -> Svg:
    axis, tx, hx, hw, top, phase_gap = 128, 148, 520, 268, 86, 22
    starts = {first for first, _, _, _ in PHASES[1:]}
    rows: list[tuple[Step, float, float]] = []
    y = top
    for i, step in enumerate(STEPS):
        if i in starts:
            y += phase_gap
        h = max(LINE * (1 + len(step.detail)) + 12, len(step.hold) * 16 + 14)
        rows.append((step, y, h))
        y += h + 8
    legend_y = y + 14
    svg = Svg("restart-timeline", 800, int(legend_y + 34), "One restart of a pod for a hang, step by step",
              "Time runs down. Evidence: three canary timeouts in a row with the server's token counter flat. "
              "The decision: hang, with no drain. The sidecar takes the stacks of every thread, records what "
              "was in flight, reads the restart budget from the workload's Events, takes a slot in the "
              "fleet's Lease, counts the workload's pods again right before the act, asks with a dry-run "
              "eviction, writes the restart Event, and evicts (a drain, at most restart.drain_timeout, is not "
              "done for hang or context_loss). The replacement pod starts, is not restarted before "
              "policy.startup_timeout, serves its first canary, and its sidecar gives the slot back. "
              "The restart can be held at the budget, the slot, the recount, the dry run and the Event.")
    svg.text(20, 28, "One pod restart for a hang (restart.strategy evict), as the sidecar does it", STYLES["b"])
    svg.text(20, 48, "Time runs down. In red: where the restart can be held, and what then happens.", STYLES["s"])
    svg.text(hx, 76, "can hold it", Style(12, "bold", HOLD[1]))
    # The axis, broken between the phases (their lengths differ by orders of magnitude).
    for n, (first, last, what, how) in enumerate(PHASES):
        y0 = rows[first][1] - 4
        y1 = rows[last][1] + rows[last][2] + 4
        svg.parts.append(f'<line x1="{axis}" y1="{num(y0)}" x2="{axis}" y2="{num(y1)}" stroke="{MUTED}" '
                         'stroke-width="2"/>')
        mid = (y0 + y1) / 2
        svg.text(axis - 16, mid - 2, what, STYLES["b"], "end")
        svg.text(axis - 16, mid + 16, how, STYLES["s"], "end")
        if n + 1 < len(PHASES):
            gy = y1 + (phase_gap + 8) / 2
            svg.parts.append(f'<path d="M{axis - 7},{num(gy - 1)} l14,-6 M{axis - 7},{num(gy + 5)} l14,-6" '
                             f'stroke="{MUTED}" stroke-width="1.5"/>')
    svg.arrow([(axis, y - 4), (axis, y + 6)], MUTED)
    for step, ry, _ in rows:
        fill = WHITE if step.skipped else step.colors[1]
        svg.parts.append(f'<circle cx="{axis}" cy="{num(ry + 12)}" r="6" fill="{fill}" stroke="{step.colors[1]}" '
                         'stroke-width="2"/>')
        svg.lines(tx, ry, [(step.title, "b"), *step.detail], "start", fill=MUTED if step.skipped else None)
        if step.hold:
            svg.rect(hx, ry, hw, len(step.hold) * 16 + 10, HOLD)
            svg.lines(hx + 10, ry + 5, step.hold, "start", step=16)
        elif step.note or step.skipped:
            svg.lines(hx + 10, ry + 5, [(t, "s") for t in step.note or ("skipped for this restart",)], "start",
                      step=16)
    # The legend: where each step happens, and what can hold it.
    x = 20
    for colors, what in ((WATCHDOG, "the sidecar"), (INFERENCE, "the control API"),
                         (CLUSTER, "Kubernetes API, Lease"), (GPU, "the replacement pod")):
        svg.parts.append(f'<circle cx="{x + 6}" cy="{num(legend_y + 10)}" r="6" fill="{colors[1]}"/>')
        svg.text(x + 18, legend_y + 15, what, STYLES["s"])
        x += 36 + len(what) * 7
    svg.rect(x, legend_y + 3, 14, 14, HOLD, rx=3)
    svg.text(x + 20, legend_y + 15, "can hold the restart", STYLES["s"])
    return svg


PICTURES = {"docs/pictures/pod.svg": pod, "docs/pictures/ladder.svg": ladder,
            "docs/pictures/restart-timeline.svg": timeline}


def render() -> dict[str, str]:
    """Each picture's path (relative to the repository) and its SVG text."""
    return {path: make().render() for path, make in PICTURES.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file differs from what would be written")
    args = parser.parse_args(argv)
    differ = []
    for rel, text in render().items():
        path = ROOT / rel
        if args.check:
            current = path.read_text(encoding="utf-8") if path.exists() else None
            if current != text:
                differ.append(rel)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8", newline="\n")
        print(f"wrote {rel}")
    for rel in differ:
        print(f"{rel} differs from what tools/pictures.py writes: run `python tools/pictures.py`", file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
