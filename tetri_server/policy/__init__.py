"""Scheduling policies. PURE and synchronous: no torch, asyncio, aiohttp or cupy; no clock
reads, no I/O. Time (``now_s``), randomness (``random.Random``) and ids are passed in. Workers
and the simulator run the same objects: ``plan = policy.plan(...)``, the runtime executes it,
``policy.on_done(...)``.
"""

from __future__ import annotations

from tetri_server.policy.chunker import (
    Chunker,
    ChunkPlan,
    MixedStepPlan,
    coupled_chunked_plan,
    num_blocks_for,
    prefill_first_plan,
    take_slices,
)
from tetri_server.policy.coupled import coupled_step_plan
from tetri_server.policy.decode import (
    DECODE_POLICIES,
    ESTIMATES,
    AdmitPlan,
    DecodeAdmission,
    DecodeLoad,
    DecodePolicyName,
    DecodeStepPlan,
    EstimateName,
    PreemptPlan,
)
from tetri_server.policy.dispatch import (
    Dispatcher,
    DispatchPlan,
    RoundRobinDispatcher,
    TetriDispatcher,
)
from tetri_server.policy.elastic import (
    LocalDecode,
    LocalDecodeKeys,
    LocalSteps,
    PromptShare,
    StepTimes,
    calibration_rows,
    kept_gap_s,
    kept_prompt_room,
    local_decode_of,
    mixed_chunk,
)
from tetri_server.policy.flip import FlipPlan, FlipPolicy
from tetri_server.policy.global_sched import LeastLoadedPicker
from tetri_server.policy.knee import (
    CALIBRATION_SIZES,
    RIDER_CONTEXT,
    pick_chunk_size,
    throughput_curve,
)
from tetri_server.policy.local_prefill import DecodeRoom, LocalPrefill, head_prompt_need
from tetri_server.policy.prefill import (
    PREFILL_ORDERS,
    ChunkSlice,
    PrefillOrder,
    PrefillQueue,
    QueuedPrompt,
)
from tetri_server.policy.prefill_book import PrefillBook, Stage
from tetri_server.policy.remaining import LengthTail
from tetri_server.policy.views import DecodeInstance, DecodeInstanceLoad, DecodeSnapshot, WorkerLoad

__all__ = [
    "DecodeInstance",
    "DecodeInstanceLoad",
    "DecodeRoom",
    "DecodeSnapshot",
    "WorkerLoad",
    "DECODE_POLICIES",
    "ESTIMATES",
    "PREFILL_ORDERS",
    "RIDER_CONTEXT",
    "AdmitPlan",
    "ChunkPlan",
    "ChunkSlice",
    "Chunker",
    "DecodeAdmission",
    "DecodeLoad",
    "DecodePolicyName",
    "DecodeStepPlan",
    "EstimateName",
    "DispatchPlan",
    "Dispatcher",
    "FlipPlan",
    "FlipPolicy",
    "LeastLoadedPicker",
    "LengthTail",
    "LocalDecode",
    "LocalDecodeKeys",
    "PromptShare",
    "StepTimes",
    "LocalPrefill",
    "head_prompt_need",
    "kept_prompt_room",
    "LocalSteps",
    "MixedStepPlan",
    "PreemptPlan",
    "PrefillBook",
    "PrefillOrder",
    "PrefillQueue",
    "QueuedPrompt",
    "RoundRobinDispatcher",
    "Stage",
    "TetriDispatcher",
    "calibration_rows",
    "coupled_chunked_plan",
    "coupled_step_plan",
    "kept_gap_s",
    "local_decode_of",
    "mixed_chunk",
    "num_blocks_for",
    "pick_chunk_size",
    "CALIBRATION_SIZES",
    "prefill_first_plan",
    "take_slices",
    "throughput_curve",
]
