"""Paged KV cache bookkeeping: blocks, the free queue, prefix-cache hashes, per-request blocks.

Pure Python, no torch: this module decides which block ids hold which tokens; the model
runner owns the tensors. Written by hand because it is the engine's core data structure
and no library offers it with these invariants.

A request's tokens fill fixed-size blocks, in order (``block_size = 4`` here)::

    token ids:  [ t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 ]
    block ids:  [      7      |      2      |   5   ]   KVCacheManager.get_block_ids(req)
    hashes:     [     h0      |     h1      ]           request.block_hashes (full blocks only)

    h0 = H(ROOT, (t0, t1, t2, t3), extra_keys)    extra_keys = (cache_salt,) or None
    h1 = H(h0,   (t4, t5, t6, t7), None)

A block's hash therefore names its whole prefix, so a chain of hits can only start at the
first block. A full block is entered in the prefix cache as soon as it is scheduled (its K/V
are written in that step's forward pass, before any later request of the batch reads them).

Block life cycle (a block is free iff its ``ref_cnt`` is 0, and then it is in the queue)::

    free                -- get_new_blocks -->  in use  (a cached block is evicted first)
    in use              -- last free_blocks -> free    (a cached block stays cached)
    in use, full        -- cache_block ----->  in use, cached   (when its tokens are scheduled)
    free or in use,     -- touch ----------->  in use, cached   (a prefix hit; ref_cnt + 1)
      cached

Free queue order: the head is reused first. Freed cached blocks go to the tail, last block
of a request first, so a chain is evicted from its end and its shared beginning lives
longest (LRU over chains). Freed blocks with no hash hold nothing reusable and go to the
head, so they are reused before any cached block is evicted.

All counts are in blocks unless a name says tokens.
"""

from __future__ import annotations

import bisect
import hashlib
import pickle
import sys
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

from pagedllm.core.request import Request

# The parent value of a request's first block.
ROOT_HASH_VALUE = hashlib.sha256(b"pagedllm.prefix-cache.root").digest()


def block_digest(
    parent_value: bytes, token_ids: tuple[int, ...], extra_keys: tuple | None
) -> bytes:
    """SHA-256 of one block's identity; deterministic across processes and runs."""
    payload = pickle.dumps((parent_value, token_ids, extra_keys), protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.sha256(payload).digest()


class BlockHash(NamedTuple):
    """The identity of a full block: its digest plus everything the digest was computed from.

    ``hash()`` uses the digest only; equality compares every field. So two blocks whose
    digests collide share a dict bucket but never match unless their tokens, extra keys and
    parent digests are equal too: a prefix-cache hit checks the tokens, it does not trust
    the hash alone. (The parent's tokens were checked one block earlier in the same lookup;
    a false hit would take two different parents with equal SHA-256 digests.)
    """

    value: bytes
    parent_value: bytes
    token_ids: tuple[int, ...]
    extra_keys: tuple | None

    def __hash__(self) -> int:
        return hash(self.value)


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    """The hash of a full block whose predecessor has hash ``parent`` (None: first block)."""
    parent_value = ROOT_HASH_VALUE if parent is None else parent.value
    token_ids = tuple(token_ids)
    return BlockHash(block_digest(parent_value, token_ids, extra_keys), parent_value, token_ids,
                     extra_keys)


class KVCacheBlock:
    """One block of ``block_size`` token slots.

    ``ref_cnt`` counts the running requests that hold the block; at 0 it sits in the free
    queue. ``block_hash`` is set only while the block is full and in the prefix cache.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """Free blocks as a doubly linked list threaded through the blocks themselves.

    Every operation is O(1) and allocates nothing: ``popleft``, ``remove`` (a prefix hit
    takes a free cached block out of the middle), ``append`` and ``appendleft``. Two sentinel
    blocks (id -1) bound the list so no operation branches on emptiness of a neighbour.
    Initially holds the given blocks in order.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("No free blocks left.")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"Asked for {n} free blocks, only {self.num_free_blocks} are free.")
        out = []
        block = self._head.next_free_block
        for _ in range(n):
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"Block {block.block_id} is not in the free queue.")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._link(self._tail.prev_free_block, block, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._link(self._head, block, self._head.next_free_block)

    def _link(self, before: KVCacheBlock, block: KVCacheBlock, after: KVCacheBlock) -> None:
        """Insert ``block`` between the adjacent ``before`` and ``after``."""
        before.next_free_block = block
        block.prev_free_block = before
        block.next_free_block = after
        after.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head (reused first) to tail. O(n): for tests and debugging."""
        out = []
        block = self._head.next_free_block
        while block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """All blocks, the free queue, and the prefix cache's hash -> block map.

    Invariant: a block is in the free queue iff its ``ref_cnt`` is 0; a block is in
    ``cached_block_hash_to_block`` iff its ``block_hash`` is set, whether free or in use.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evictable)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue, evicting their cached contents."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Enter a full, in-use block in the prefix cache.

        Returns False (and leaves the block uncached) when a block with equal contents is
        already cached: the first copy keeps serving hits.
        """
        if block.block_hash is not None or block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; ``ordered_blocks`` are in eviction order.

        Blocks reaching ref_cnt 0 rejoin the free queue: cached ones at the tail, in the
        given order (still hits until evicted), uncached ones at the head (reused first).
        """
        queue = self.free_block_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"Block {block.block_id} was freed more often than taken.")

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; no later lookup hits a block cached before the reset.

        Blocks in use keep their contents and owners; they are simply no longer shareable.
        """
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if self.cached_block_hash_to_block.get(block_hash) is block:
            del self.cached_block_hash_to_block[block_hash]
        block.block_hash = None


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups, in tokens: ``queries`` looked up, ``hits`` found cached."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class HostBlockPool:
    """Blocks of host memory that hold the KV of swapped-out requests, handed out as
    contiguous runs so that one copy per layer moves a request's blocks either way.

    Free runs are kept sorted by start and merged with their neighbours when freed."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self._free: list[tuple[int, int]] = [(0, num_blocks)]  # (start, length)

    @property
    def num_free_blocks(self) -> int:
        return sum(length for _, length in self._free)

    def allocate(self, count: int) -> int | None:
        """The first block of ``count`` contiguous free blocks (the first run that fits),
        now taken; None when no run is that long."""
        for i, (start, length) in enumerate(self._free):
            if length >= count:
                if length == count:
                    del self._free[i]
                else:
                    self._free[i] = (start + count, length - count)
                return start
        return None

    def free(self, start: int, count: int) -> None:
        """Give back the ``count`` blocks from ``start`` (taken by ``allocate``)."""
        i = bisect.bisect(self._free, (start, count))
        if i < len(self._free) and self._free[i][0] == start + count:  # joins the next run
            count += self._free.pop(i)[1]
        if i and sum(self._free[i - 1]) == start:  # joins the previous run
            start, previous = self._free[i - 1]
            self._free[i - 1] = (start, previous + count)
        else:
            self._free.insert(i, (start, count))


class KVCacheManager:
    """Which blocks each running request holds, and the prefix cache over them.

    A request holding blocks covers ``len(blocks) * block_size >= num_computed_tokens`` (plus
    the tokens scheduled this step) with its blocks, in token order. Requests share a block
    only through a prefix-cache hit, and only full blocks are shared.

    ``watermark`` (a fraction of the pool, default 0) is kept free when admitting a request
    that holds no blocks yet, so running requests have room to grow before preemption; it
    is waived when the pool is entirely free, so a lone request always gets in.

    ``num_host_blocks`` (default 0: none) blocks of host memory take the KV of requests
    swapped out at preemption (``swap_out``) until they are swapped back in (``swap_in``):
    the manager names which blocks move where; the model runner copies them before the
    step's forward pass, in order on the device, so a swapped-out request's GPU blocks may
    be handed to others in the same step.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        max_model_len: int | None = None,
        watermark: float = 0.0,
        num_host_blocks: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}.")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self._max_tokens = max_model_len if max_model_len is not None else sys.maxsize
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.num_blocks = num_blocks
        self._watermark_blocks = int(watermark * num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many of its leading blocks were handed to the prefix cache
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.host_pool = HostBlockPool(num_host_blocks) if num_host_blocks else None
        # swapped-out request id -> (first host block, blocks) holding its computed tokens
        self._swapped: dict[str, tuple[int, int]] = {}

    # -- counts -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the KV cache held by requests, in [0, 1]."""
        return self.block_pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    # -- prefix cache -------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks that starts the request's tokens.

        Returns ``(blocks, num_computed_tokens)``. The hit never covers the request's last
        token, whose logits are needed to sample the next one: at most
        ``(num_tokens - 1) // block_size`` blocks. Nothing is taken or reserved; pass the
        blocks to ``allocate_slots``, which counts the lookup in ``prefix_cache_stats``
        once the request is admitted (a request that waits for room is counted once).
        """
        if not self.enable_caching or not request.use_prefix_cache:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        cached = self.block_pool.cached_block_hash_to_block
        blocks: list[KVCacheBlock] = []
        for i in range(max_hit_blocks):
            if i == len(hashes):  # hash lazily: a miss on block 0 costs one hash
                self._extend_block_hashes(request, i + 1)
            block = cached.get(hashes[i])
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()

    # -- allocation ---------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Make the request's blocks cover its computed tokens plus ``num_new_tokens``.

        ``new_computed_blocks`` / ``num_new_computed_tokens`` are a prefix hit from
        ``get_computed_blocks`` for a request being admitted. Returns the ids of the blocks
        newly taken from the free queue (hits excluded; possibly empty), or None, with no
        side effect, when the free blocks do not suffice. Afterwards the request's blocks
        that the scheduled tokens fill are entered in the prefix cache.
        """
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is not None and not new_computed_blocks and num_new_tokens > 0:
            # Fast path (most decodes): the held blocks already have room.
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(blocks) * self.block_size and num_tokens <= self._max_tokens:
                if (self.enable_caching
                        and num_tokens // self.block_size > self._num_cached_blocks[req_id]):
                    self._cache_full_blocks(request, blocks, num_tokens)
                return []
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}.")
        admitting = blocks is None
        num_held = 0 if admitting else len(blocks)
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if num_tokens > self._max_tokens:
            raise ValueError(
                f"Request {req_id!r} would hold {num_tokens} tokens of context, more than "
                f"max_model_len={self.max_model_len}."
            )
        num_new_blocks = cdiv(num_tokens, self.block_size) - num_held - len(new_computed_blocks)
        num_new_blocks = max(num_new_blocks, 0)
        if num_new_blocks or new_computed_blocks or admitting:
            if not self._can_allocate(num_new_blocks, new_computed_blocks, admitting):
                return None
            if admitting:
                blocks = self.req_to_blocks[req_id] = []
                self._num_cached_blocks[req_id] = 0
                if self.enable_caching and request.use_prefix_cache:
                    self.prefix_cache_stats.queries += request.num_tokens
                    self.prefix_cache_stats.hits += num_new_computed_tokens
            if new_computed_blocks:
                self.block_pool.touch(new_computed_blocks)
                blocks.extend(new_computed_blocks)
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            blocks.extend(new_blocks)
            new_block_ids = [block.block_id for block in new_blocks]
        else:
            new_block_ids = []
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_tokens)
        return new_block_ids

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (evicted before its prefix), and
        the host blocks it was swapped out to, if any."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
        swapped = self._swapped.pop(request.request_id, None)
        if swapped is not None:
            self.host_pool.free(*swapped)

    # -- swapping -----------------------------------------------------------------------
    def is_swapped_out(self, request: Request) -> bool:
        return request.request_id in self._swapped

    def swap_out(self, request: Request) -> tuple[int, list[int]] | None:
        """Move the KV of the request's computed tokens to host blocks: returns ``(first
        host block, GPU block ids)``, GPU block ``i`` going to host block ``first + i``, and
        frees the GPU blocks; None, changing nothing, when the host has no free run that
        long (or the request has nothing computed)."""
        blocks = self.req_to_blocks.get(request.request_id)
        count = cdiv(request.num_computed_tokens, self.block_size)
        if self.host_pool is None or not blocks or count == 0:
            return None
        start = self.host_pool.allocate(count)
        if start is None:
            return None
        block_ids = [block.block_id for block in blocks[:count]]
        self.free(request)
        self._swapped[request.request_id] = (start, count)
        return start, block_ids

    def swap_in(self, request: Request, num_new_tokens: int) -> tuple[int, list[int]] | None:
        """GPU blocks again for a swapped-out request's ``num_computed_tokens`` plus
        ``num_new_tokens``: returns ``(first host block, GPU block ids)``, host block
        ``first + i`` going to GPU block ``i`` (the request holds these and any blocks for
        the new tokens after them), or None, changing nothing, when the GPU blocks do not
        suffice. The host blocks stay taken until ``release_host``: the copy reads them when
        the step runs."""
        start, count = self._swapped[request.request_id]
        computed = request.num_computed_tokens
        request.num_computed_tokens = 0  # allocated as an admission of every token
        try:
            block_ids = self.allocate_slots(request, computed + num_new_tokens)
        finally:
            request.num_computed_tokens = computed
        if block_ids is None:
            return None
        del self._swapped[request.request_id]
        return start, block_ids[:count]

    def release_host(self, start: int, count: int) -> None:
        """Free host blocks a swap-in has read (its step has run)."""
        self.host_pool.free(start, count)

    def _can_allocate(
        self, num_new_blocks: int, new_computed_blocks: Sequence[KVCacheBlock], admitting: bool
    ) -> bool:
        num_free = self.block_pool.num_free_blocks
        # A hit block with ref_cnt 0 is counted as free but stops being free once touched.
        num_evictable_hits = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0:
                num_evictable_hits += 1
        reserve = self._watermark_blocks if admitting and num_free < self.num_blocks else 0
        return num_new_blocks + num_evictable_hits + reserve <= num_free

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        # Only known tokens (prompt + outputs) can be hashed.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        req_id = request.request_id
        start = self._num_cached_blocks[req_id]
        if num_full <= start:
            return
        hashes = self._extend_block_hashes(request, num_full)
        pool = self.block_pool
        for i in range(start, num_full):
            if blocks[i].block_hash is None:  # hits are cached already
                pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[req_id] = num_full

    def _extend_block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Hash the request's full blocks up to ``num_blocks`` (incremental, kept on it)."""
        hashes = request.block_hashes
        size = self.block_size
        tokens = request.all_token_ids
        if num_blocks * size > len(tokens):
            raise ValueError(
                f"Block {num_blocks - 1} of request {request.request_id!r} is not full."
            )
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            extra = (request.cache_salt,) if i == 0 and request.cache_salt is not None else None
            parent = hash_block_tokens(parent, tokens[i * size:(i + 1) * size], extra)
            hashes.append(parent)
        return hashes
