"""Reserved memory from a trace: the order of a traced step's allocations and frees (live.py's event log)
replayed through PyTorch's CUDA caching allocator's rules, so that a trace says what
torch.cuda.memory_reserved() would (what torchtitan logs as its memory: reserved_bytes.all.peak,
torchtitan/metrics.py at 9dec370) and not only what live tensors add up to (memory_allocated).

The rules, from c10/cuda/CUDACachingAllocator.cpp (the same in torch 2.5-2.13 for what is used here):
  - a request is rounded up to a multiple of 512 bytes (kMinBlockSize, round_size);
  - requests of at most 1 MiB (kSmallSize) come from the small pool, larger ones from the large pool;
  - the smallest free block of the pool that fits is taken (best fit: the pool's set ordered by size,
    lower_bound), and split when what is left is at least 512 bytes (small pool) or more than 1 MiB
    (large pool; should_split);
  - with no block fitting, a new segment is cudaMalloc'd: 2 MiB (kSmallBuffer) for a small request,
    20 MiB (kLargeBuffer) for one under 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB
    (kRoundLarge; get_allocation_size);
  - a freed block merges with its free neighbours in its segment (free_block, try_merge_blocks); a
    segment is never merged with another and is returned to the driver only by empty_cache or when a
    cudaMalloc fails (release_cached_blocks), neither of which a run with memory to spare meets;
  - under expandable_segments:True (torchtitan's run_llama_train.sh sets it) each pool is one segment
    whose mapped end grows, in 2 MiB pages, by what a request lacks beyond its free tail block.
One stream: a trace has none (the collectives' streams' own pools are not replayed; see `replay`).
"""

from __future__ import annotations

import bisect
import itertools

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
PAGE = 2 << 20  # an expandable segment's mapping granularity on Hopper


def round_size(n: int) -> int:
    return max(MIN_BLOCK, -(-n // MIN_BLOCK) * MIN_BLOCK)


def segment_size(n: int) -> int:
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-n // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("small", "start", "size", "free", "prev", "next", "order")

    def __init__(self, small, start, size, order):
        self.small, self.start, self.size, self.free = small, start, size, True
        self.prev = self.next = None
        self.order = order


class CachingAllocator:
    """The caching allocator's bookkeeping (module docstring): malloc/free by key, reserved and its peak."""

    def __init__(self, expandable: bool = False):
        self.expandable = expandable
        self.pools = {True: [], False: []}  # small?: sorted [(size, order, block)] of free blocks
        self.blocks: dict[int, _Block] = {}
        self.tail = {True: None, False: None}  # an expandable pool's last block
        self.reserved = self.peak_reserved = 0
        self.allocated = self.peak_allocated = 0
        self.free_at_peak: list[int] = []  # the free blocks' sizes when reserved last reached its peak
        self._order = itertools.count()

    def _insert(self, b: _Block, small: bool) -> None:
        bisect.insort(self.pools[small], (b.size, b.order, b))

    def _remove(self, b: _Block, small: bool) -> None:
        pool = self.pools[small]
        del pool[bisect.bisect_left(pool, (b.size, b.order))]

    def _new_block(self, small, start, size) -> _Block:
        return _Block(small, start, size, next(self._order))

    def malloc(self, key: int, nbytes: int) -> None:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        grown = i >= len(pool)
        block = pool.pop(i)[2] if not grown else self._grow(size, small)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = self._new_block(small, block.start + size, rest)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            elif self.tail[small] is block:
                self.tail[small] = tail
            block.next, block.size = tail, size
            self._insert(tail, small)
        block.free = False
        self.blocks[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        if grown and self.reserved == self.peak_reserved:  # what the request could not use stays cached
            self.free_at_peak = [b.size for pool in self.pools.values() for _, _, b in pool]

    def _grow(self, size: int, small: bool) -> _Block:
        """A free block of at least `size` bytes from the driver: a new segment, or a grown expandable one."""
        if not self.expandable:
            seg = segment_size(size)
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            return self._new_block(small, 0, seg)
        last = self.tail[small]
        have = last.size if last is not None and last.free else 0
        more = -(-(size - have) // PAGE) * PAGE
        self.reserved += more
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        if have:
            self._remove(last, small)
            last.size += more
            return last
        block = self._new_block(small, (last.start + last.size) if last else 0, more)
        block.prev = last
        if last is not None:
            last.next = block
        self.tail[small] = block
        return block

    def free(self, key: int) -> None:
        block = self.blocks.pop(key, None)
        if block is None:
            return
        small = block.small
        self.allocated -= block.size
        block.free = True
        for other in (block.prev, block.next):
            if other is not None and other.free:
                self._remove(other, small)
                first, second = (other, block) if other is block.prev else (block, other)
                first.size += second.size
                first.next = second.next
                if second.next is not None:
                    second.next.prev = first
                if self.tail[small] is second:
                    self.tail[small] = first
                block = first
        self._insert(block, small)


def replay(events, held: dict[int, int], repeats: int = 3, expandable: bool = False) -> CachingAllocator:
    """Replay a traced step's events ((+1, key, bytes) allocated, (-1, key, 0) freed) `repeats` times after
    allocating what is held when the step starts (`held`: key -> bytes, the model states), as successive
    steps run: the caching allocator keeps what a step reserved for the next, so the peak reserved of the
    last repeat is the run's steady state (torchtitan reads it at step 90)."""
    alloc = CachingAllocator(expandable)
    for key, n in held.items():
        alloc.malloc(("held", key), n)
    for r in range(repeats):
        if r:  # what the last step left allocated is freed as the next starts (zero_grad(set_to_none=True))
            for k in [k for k in alloc.blocks if k[0] != "held" and k[1] == r - 1]:
                alloc.free(k)
        for sign, key, n in events:
            k = (key, r) if key not in held else ("held", key)
            if sign > 0:
                if k in alloc.blocks:  # a held storage re-allocated in place (FSDP2's resize): free, then allocate
                    alloc.free(k)
                alloc.malloc(k, n)
            else:
                alloc.free(k)
    return alloc
