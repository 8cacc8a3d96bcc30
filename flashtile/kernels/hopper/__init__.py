"""The Hopper (sm90) kernels: Gluon, warp-specialized, TMA and wgmma.

Device code: forward.py, backward.py (and the dQ convert), block_info.py (tile ranges and which
tiles need masks), seqlen_info.py (where a sequence lives), tile_order.py (causal launch order).
Host side: tma.py (which tensors TMA can address; descriptor templates), forward_plan.py and
backward_plan.py (launch plans of one call signature), launch.py (the backward as a whole, in head
chunks, and the calling convention the dispatcher uses).
"""
