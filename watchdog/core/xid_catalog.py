"""What the driver says a GPU fault needs: NVIDIA's Xid catalog and NVML's GPU recovery action, as data.

Source: the NVIDIA Xid catalog, docs.nvidia.com/deploy/xid-errors ("Analyzing Xid Errors with the Xid
Catalog", Ampere and newer), column "Resolution Bucket (Immediate Action)", bucket names verbatim; and
NVML's `nvmlDeviceGpuRecoveryAction_t` (field `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`, id 230), with
the meanings of docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt ("Error Recovery and Response Flags").

The rows are the catalog's facts; `REMEDY` and `RECOVERY_ACTIONS` are this watchdog's reading of them
(whether its own restart can help, and what the node needs on top), said once here so that the policy,
the Node report and the docs derive from one place. Pure data: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

# The catalog's Resolution Buckets (Immediate Action) that rows below use.
RESTART_APP = "RESTART_APP"
RESET_GPU = "RESET_GPU"
RESTART_BM = "RESTART_BM"  # reboot the (bare-metal) machine
RESTART_VM = "RESTART_VM"
CONTACT_SUPPORT = "CONTACT_SUPPORT"
IGNORE = "IGNORE"
CHECK_MECHANICALS = "CHECK_MECHANICALS"
WORKFLOW_XID_45 = "WORKFLOW_XID_45"
WORKFLOW_XID_48 = "WORKFLOW_XID_48"
WORKFLOW_NVLINK_ERR = "WORKFLOW_NVLINK_ERR"
WORKFLOW_NVLINK5_ERR = "WORKFLOW_NVLINK5_ERR"
XID_154 = "XID_154"

# What the node needs beyond a new process, in the words of a decision's `node_action`.
NODE_RESET_GPU, NODE_REBOOT = "reset_gpu", "reboot"


@dataclass(frozen=True)
class Xid:
    code: int
    mnemonic: str
    meaning: str  # the catalog's description, shortened
    bucket: str  # Resolution Bucket (Immediate Action), as the catalog spells it
    ecc: bool = False  # an uncorrectable ECC error the application saw (the `ecc` class of our Events)


_ROWS = (
    Xid(8, "ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "GPU stopped processing", RESTART_APP),
    Xid(11, "ROBUST_CHANNEL_GR_ERROR_MISSING_HW", "invalid or corrupted push buffer stream", RESTART_APP),
    Xid(13, "ROBUST_CHANNEL_GR_EXCEPTION", "graphics engine exception", RESTART_APP),
    Xid(31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "GPU memory page fault", RESTART_APP),
    Xid(32, "ROBUST_CHANNEL_PBDMA_ERROR", "invalid or corrupted push buffer stream", RESTART_APP),
    Xid(38, "ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT", "driver firmware error", IGNORE),
    Xid(43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "GPU stopped processing", IGNORE),
    Xid(44, "ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW", "graphics engine fault during context switch", IGNORE),
    Xid(45, "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "preemptive cleanup, due to previous errors", WORKFLOW_XID_45),
    Xid(46, "ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "GPU stopped processing", RESET_GPU),
    Xid(48, "ROBUST_CHANNEL_GPU_ECC_DBE", "double-bit ECC error", WORKFLOW_XID_48, ecc=True),
    Xid(54, "SILENT_RUNNING_PWR_REDUCED_CLOCKING", "auxiliary power is not connected to the board",
        CHECK_MECHANICALS),
    Xid(61, "PMU_BREAKPOINT", "internal micro-controller breakpoint (unused on Ampere and newer)",
        CONTACT_SUPPORT),
    Xid(62, "PMU_HALT_ERROR", "internal micro-controller halt", RESET_GPU),
    Xid(63, "INFOROM_DRAM_RETIREMENT_EVENT", "GPU memory remapping event", IGNORE),
    Xid(64, "INFOROM_DRAM_RETIREMENT_FAILURE", "GPU memory remapping failure", RESET_GPU),
    Xid(68, "ROBUST_CHANNEL_NVDEC0_ERROR", "NVDEC0 exception", RESTART_APP),
    Xid(69, "ROBUST_CHANNEL_GR_CLASS_ERROR", "graphics engine class error", RESTART_APP),
    Xid(74, "NVLINK_ERROR", "NVLink error", WORKFLOW_NVLINK_ERR),
    Xid(79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "GPU has fallen off the bus", RESTART_BM),
    Xid(92, "EXCESSIVE_SBE_INTERRUPTS", "high single-bit ECC error rate", IGNORE),
    Xid(94, "ROBUST_CHANNEL_CONTAINED_ERROR", "contained memory error", RESTART_APP, ecc=True),
    Xid(95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "uncontained memory error", RESET_GPU),
    Xid(109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "context switch timeout error", RESET_GPU),
    Xid(110, "SEC_FAULT_ERROR", "security fault error", RESET_GPU),
    Xid(119, "GSP_RPC_TIMEOUT", "GSP RPC timeout", RESET_GPU),
    Xid(120, "GSP_ERROR", "GSP error", RESET_GPU),
    Xid(121, "C2C_ERROR", "C2C error", IGNORE),
    Xid(136, "ALI_TRAINING_FAIL", "link training failed", RESET_GPU),
    Xid(140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "ECC unrecovered error", RESET_GPU, ecc=True),
    Xid(143, "GPU_INIT_ERROR", "GPU initialization error", RESET_GPU),
    Xid(144, "NVLINK_SAW_ERROR", "NVLink: SAW error", WORKFLOW_NVLINK5_ERR),
    Xid(145, "NVLINK_RLW_ERROR", "NVLink: RLW error", WORKFLOW_NVLINK5_ERR),
    Xid(146, "NVLINK_TLW_ERROR", "NVLink: TLW error", WORKFLOW_NVLINK5_ERR),
    Xid(147, "NVLINK_TREX_ERROR", "NVLink: TREX error", WORKFLOW_NVLINK5_ERR),
    Xid(148, "NVLINK_NVLPW_CTRL_ERROR", "NVLink: NVLPW_CTRL error", WORKFLOW_NVLINK5_ERR),
    Xid(149, "NVLINK_NETIR_ERROR", "NVLink: NETIR error", WORKFLOW_NVLINK5_ERR),
    Xid(150, "NVLINK_MSE_ERROR", "NVLink: MSE error", WORKFLOW_NVLINK5_ERR),
    Xid(151, "ROBUST_CHANNEL_KEY_ROTATION_ERROR", "key rotation error", RESTART_VM),
    Xid(154, "GPU_RECOVERY_ACTION_CHANGED", "GPU recovery action changed", XID_154),
    Xid(155, "NVLINK_SW_DEFINED_ERROR", "NVLink: software-defined error", RESET_GPU),
    Xid(156, "RESOURCE_RETIREMENT_EVENT", "resource retirement event", RESET_GPU),
    Xid(157, "RESOURCE_RETIREMENT_FAILURE", "resource retirement failure", IGNORE),
    Xid(158, "GPU_FATAL_TIMEOUT", "GPU fatal timeout", RESET_GPU),
)

CATALOG: dict[int, Xid] = {x.code: x for x in _ROWS}


@dataclass(frozen=True)
class Remedy:
    """What a bucket asks of this watchdog: restart its process (or pod), and what the node needs."""

    restart: bool
    node_action: str | None = None  # NODE_RESET_GPU | NODE_REBOOT; None: a new process is the cure


REMEDY: dict[str, Remedy] = {
    RESTART_APP: Remedy(restart=True),
    RESET_GPU: Remedy(restart=True, node_action=NODE_RESET_GPU),
    RESTART_BM: Remedy(restart=True, node_action=NODE_REBOOT),
    RESTART_VM: Remedy(restart=True, node_action=NODE_REBOOT),  # the VM is the node
    # The catalog's workflow for Xid 48: a GPU reset or node reboot is needed to clear the error.
    WORKFLOW_XID_48: Remedy(restart=True, node_action=NODE_RESET_GPU),
    # NVLink (before NVLink 5): the link's GPU is reset; the workflow escalates from there.
    WORKFLOW_NVLINK_ERR: Remedy(restart=True, node_action=NODE_RESET_GPU),
    # Solo: restart the fabric manager (the node's), else follow the Xid it came with. It is also what
    # ending a process with work on the GPU logs (our own restarts among them): never a restart alone.
    WORKFLOW_XID_45: Remedy(restart=False),
    # NVLink 5: fatal or not depends on the decoded error status; the driver's verdict follows as
    # Xid 154 and the recovery action, which the policy reads itself.
    WORKFLOW_NVLINK5_ERR: Remedy(restart=False),
    XID_154: Remedy(restart=False),  # informational: the recovery action field carries the answer
    IGNORE: Remedy(restart=False),
    # Nothing a new process or our restart can change: said in the log and the Xid counter only.
    CONTACT_SUPPORT: Remedy(restart=False),
    CHECK_MECHANICALS: Remedy(restart=False),
}


def lookup(code: int) -> Xid | None:
    return CATALOG.get(code)


def remedy(code: int) -> Remedy | None:
    """What Xid `code` asks of us; None for an Xid the catalog (as held here) does not name."""
    row = CATALOG.get(code)
    return None if row is None else REMEDY[row.bucket]


# -- NVML's GPU recovery action --------------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryAction:
    value: int
    name: str  # NVML_GPU_RECOVERY_ACTION_<name>
    node_action: str | None  # what the node needs; None: nothing beyond a new process


# Every action but NONE needs more than a new process on the same GPU, so each is a restart of the
# pod (away from the card) and, where the node must act, a report on the Node at once.
RECOVERY_ACTIONS: dict[int, RecoveryAction] = {a.value: a for a in (
    # The GPU can be used again by starting a new process: no fault to act on.
    RecoveryAction(0, "NONE", None),
    # Terminate every GPU process, reset the GPU (`nvidia-smi -r`).
    RecoveryAction(1, "GPU_RESET", NODE_RESET_GPU),
    # The fault may have left the OS inconsistent: reboot it.
    RecoveryAction(2, "NODE_REBOOT", NODE_REBOOT),
    # Peer-to-peer traffic must be quiesced: every process doing it ends (ours, and other pods' on the
    # node, which only the node can drain); the field then says which action follows.
    RecoveryAction(3, "DRAIN_P2P", "drain_p2p"),
    # Drain as above, then reset the GPU.
    RecoveryAction(4, "DRAIN_AND_RESET", NODE_RESET_GPU),
    # The multi-node NVLink (IMEX) domain needs recovering: a fabric-level action, not ours.
    RecoveryAction(5, "RECOVER_IMEX_DOMAIN", "recover_imex_domain"),
    # Reset the GPU's PCIe bus: a reset beyond what the driver does on its own.
    RecoveryAction(6, "BUS_RESET", NODE_RESET_GPU),
    # Reboot the system (power cycle included).
    RecoveryAction(7, "SYSTEM_REBOOT", NODE_REBOOT),
)}


def recovery_action(value: int | None) -> RecoveryAction | None:
    """The action NVML reported; None where nothing is asked (NONE) or nothing was read.

    A value newer than this table is read as the driver asking the node for something we cannot name:
    every action it has defined so far needs more than a new process."""
    if value is None or value == 0:
        return None
    return RECOVERY_ACTIONS.get(value) or RecoveryAction(value, f"UNKNOWN_{value}", f"recovery_action_{value}")
