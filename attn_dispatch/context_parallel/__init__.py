"""Context parallelism: attention over a sequence split across ranks (Transformer Engine / Megatron style).

    from attn_dispatch import context_parallel as cp
    q_local = cp.shard(q, "bshd", cp_size, cp_rank)            # load-balanced layout
    out_local = cp.attention(None, q_local, k_local, v_local, aux, cfg, cp_group=group, cp_comm_type="p2p")
    # engine None: each block's engine is chosen by selection; or pass one Engine for every block
    out = cp.gather(out_local, "bshd", group)                  # whole sequence again (not differentiable)

Comm types: 'p2p' (ring), 'all_gather', 'a2a' (Ulysses), 'a2a+p2p' (cp_group = [a2a_group, p2p_group]).
attn_dispatch.constraints.context_parallel says what each supports (sliding windows included). Transport:
torch.distributed's collectives and send/recv (gloo on CPU, NCCL on GPUs), except ring hops on CUDA with an NCCL
group, which the copy engines pull from symmetric memory once the group's self-check passes (copy_engine.py).
"""
from .api import attention
from .sharding import (RankOrder, chunks_of_rank, cp_rank_of, cp_size_of, gather, local_cu_seqlens, shard,
                       thd_natural_index, unshard)
from .engines import SelectedPerBlock
from .support import (COMM_TYPES, SUPPORT, CommTypeSupport, block_params, engine_block_params, params_failures,
                      unsupported_features)

__all__ = [
    "COMM_TYPES", "SUPPORT", "CommTypeSupport", "RankOrder", "SelectedPerBlock", "attention", "block_params",
    "chunks_of_rank", "cp_rank_of",
    "cp_size_of", "engine_block_params", "gather", "local_cu_seqlens", "params_failures", "shard",
    "thd_natural_index", "unshard", "unsupported_features",
]
