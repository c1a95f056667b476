// gpucast P2P broadcast kernels. Compiled at run time with NVRTC; the Rust side prepends the
// GPUCAST_* #defines (layout, geometry), so both sides share one definition (src/plan.rs).
//
// Every GPU of the clique launches the same kernel with the same grid for each broadcast, in the
// same order. Per-block counters live in device memory and advance on the device, so a captured
// CUDA graph replays correctly. Every flag word has exactly one writer. Waits are bounded by
// %globaltimer: on timeout a record goes to a host-mapped error slot and the kernel returns.

typedef unsigned int u32;
typedef unsigned long long u64;

struct Params {
    u64 src;                       // root's input (readable by every GPU through P2P)
    u64 dst;                       // this GPU's output
    u64 bytes;                     // message length
    u64 signal[GPUCAST_MAX_GPUS];  // each rank's signal area (flags, then packet inbox)
    u64 error_slot;                // host-mapped u64 of this rank: first timeout record
    u64 timeout_ns;                // bound on every wait
    u32 rank;
    u32 nranks;
    u32 root;
    u32 unit;                      // pull: access width of the body (16, 8, 4, 2, 1)
    u32 head;                      // pull: bytes before the aligned body
    u32 chunk;                     // packet: data bytes per block
    u32 pad0;
    u32 pad1;
};

#define PHASE_PACKET_SLOT 1u  // root waits for a peer to free the inbox slot
#define PHASE_PACKET_DATA 2u  // peer waits for the root's packets
#define PHASE_PULL_ARRIVE 3u  // peer waits for the root to arrive
#define PHASE_PULL_DONE 4u    // root waits for peers to finish reading

__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 ld_volatile(const u32* p) {
    u32 v;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_volatile(u32* p, u32 v) {
    asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint4 ld_volatile_v4(const u32* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

// One 16-byte packet: {data0, flag, data1, flag}. The hardware writes each 8-byte half at once,
// so a reader that sees both flags equal to the op's counter has both data words of this op.
__device__ __forceinline__ void st_packet(u32* p, u32 d0, u32 d1, u32 flag) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d0), "r"(flag),
                 "r"(d1), "r"(flag)
                 : "memory");
}

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Counters wrap at 2^32; compare by signed distance.
__device__ __forceinline__ bool reached(u32 value, u32 target) { return (int)(value - target) >= 0; }

// Where a rank reports a timeout, and how long it waits.
struct Bound {
    u64 error_slot;
    u64 timeout_ns;
};

__device__ void report_timeout(const Bound& p, u32 phase, u32 seq) {
    volatile u64* slot = (volatile u64*)p.error_slot;
    u64 record = (1ull << 56) | ((u64)phase << 48) | ((u64)(blockIdx.x & 0xffff) << 32) | seq;
    if (*slot == 0) *slot = record;
}

// Spins until *flag reaches target. Returns false (and raises the block's abort flag) on
// timeout, or when another thread of the block already gave up.
__device__ bool wait_flag(const u32* flag, u32 target, const Bound& p, u32 phase, u32 seq,
                          volatile int* abort) {
    if (reached(ld_acquire(flag), target)) return true;
    u64 start = now_ns();
    while (true) {
        for (int i = 0; i < 32; i++) {
            if (reached(ld_acquire(flag), target)) return true;
        }
        if (*abort) return false;
        if (now_ns() - start > p.timeout_ns) {
            report_timeout(p, phase, seq);
            *abort = 1;
            return false;
        }
    }
}

// Loads up to 16 bytes (avail of them; the rest reads as zero) from any alignment.
__device__ __forceinline__ uint4 load16(const unsigned char* s, u64 avail) {
    u64 a = (u64)s;
    if (avail >= 16) {
        if ((a & 15) == 0) return *(const uint4*)s;
        if ((a & 7) == 0) {
            u64 x = ((const u64*)s)[0], y = ((const u64*)s)[1];
            return make_uint4((u32)x, (u32)(x >> 32), (u32)y, (u32)(y >> 32));
        }
        if ((a & 3) == 0) {
            const u32* w = (const u32*)s;
            return make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
    u32 w[4] = {0, 0, 0, 0};
    u32 n = avail < 16 ? (u32)avail : 16u;
    for (u32 i = 0; i < n; i++) w[i >> 2] |= (u32)s[i] << (8 * (i & 3));
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Stores the first `avail` (<= 16 taken) bytes of v at any alignment.
__device__ __forceinline__ void store16(unsigned char* d, uint4 v, u64 avail) {
    u64 a = (u64)d;
    if (avail >= 16) {
        if ((a & 15) == 0) {
            *(uint4*)d = v;
            return;
        }
        if ((a & 7) == 0) {
            ((u64*)d)[0] = (u64)v.x | ((u64)v.y << 32);
            ((u64*)d)[1] = (u64)v.z | ((u64)v.w << 32);
            return;
        }
        if ((a & 3) == 0) {
            u32* w = (u32*)d;
            w[0] = v.x;
            w[1] = v.y;
            w[2] = v.z;
            w[3] = v.w;
            return;
        }
    }
    u32 w[4] = {v.x, v.y, v.z, v.w};
    u32 n = avail < 16 ? (u32)avail : 16u;
    for (u32 i = 0; i < n; i++) d[i] = (unsigned char)(w[i >> 2] >> (8 * (i & 3)));
}

__device__ __forceinline__ u32* signal_of(const Params& p, u32 rank) { return (u32*)p.signal[rank]; }

// ---------------------------------------------------------------------------------------------
// Packet protocol (small messages). Block b owns bytes [b*chunk, (b+1)*chunk) and, in every
// GPU's inbox, a ring of GPUCAST_PACKET_SLOTS regions. The root writes packets tagged with the
// block's op counter into each peer's region; peers poll their own memory and copy out. A slot
// is reused only after every peer has acknowledged the op that last used it (back-pressure).
// The root's input is copied into packets during the kernel, so no end barrier is needed, and
// each peer writes only its own output, so no start barrier either.
extern "C" __global__ void __launch_bounds__(GPUCAST_THREADS) gpucast_packet(const Params p) {
    __shared__ int abort_flag;
    __shared__ u32 s_seq;
    const u32 b = blockIdx.x;
    const u32 t = threadIdx.x;
    u32* mine = signal_of(p, p.rank);
    const Bound bound = {p.error_slot, p.timeout_ns};
    if (t == 0) {
        abort_flag = 0;
        s_seq = ld_volatile(mine + GPUCAST_PACKET_SEQ + b) + 1;
    }
    __syncthreads();
    const u32 seq = s_seq;
    const u64 lo = (u64)b * p.chunk;
    const u64 hi = lo + p.chunk < p.bytes ? lo + p.chunk : p.bytes;
    const u64 region = GPUCAST_INBOX_OFFSET +
                       ((u64)b * GPUCAST_PACKET_SLOTS + seq % GPUCAST_PACKET_SLOTS) *
                           (2ull * GPUCAST_PACKET_REGION_BYTES);
    const unsigned char* src = (const unsigned char*)p.src;
    unsigned char* dst = (unsigned char*)p.dst;

    if (p.rank == p.root) {
        // The slot was last used GPUCAST_PACKET_SLOTS ops ago; wait until every peer is past it.
        if (t < p.nranks && t != p.rank && seq > GPUCAST_PACKET_SLOTS) {
            wait_flag(mine + GPUCAST_PACKET_ACK + b * GPUCAST_MAX_GPUS + t, seq - GPUCAST_PACKET_SLOTS,
                      bound, PHASE_PACKET_SLOT, seq, &abort_flag);
        }
        __syncthreads();
        if (abort_flag) return;
        for (u64 off = lo + 16ull * t; off < hi; off += 16ull * blockDim.x) {
            uint4 v = load16(src + off, hi - off);
            u64 pk = region + (off - lo) * 2;  // 32 bytes of packets per 16 data bytes
            for (u32 q = 0; q < p.nranks; q++) {
                if (q == p.root) continue;
                u32* w = (u32*)(p.signal[q] + pk);
                st_packet(w, v.x, v.y, seq);
                st_packet(w + 4, v.z, v.w, seq);
            }
            if (dst != src) store16(dst + off, v, hi - off);
        }
    } else {
        const u64 base = p.signal[p.rank] + region;
        for (u64 off = lo + 16ull * t; off < hi; off += 16ull * blockDim.x) {
            const u32* w = (const u32*)(base + (off - lo) * 2);
            uint4 a = ld_volatile_v4(w), c = ld_volatile_v4(w + 4);
            if (!(a.y == seq && a.w == seq && c.y == seq && c.w == seq)) {
                u64 start = now_ns();
                u32 spins = 0;
                while (true) {
                    a = ld_volatile_v4(w);
                    c = ld_volatile_v4(w + 4);
                    if (a.y == seq && a.w == seq && c.y == seq && c.w == seq) break;
                    if ((++spins & 31) == 0) {
                        if (abort_flag) break;
                        if (now_ns() - start > p.timeout_ns) {
                            report_timeout(bound, PHASE_PACKET_DATA, seq);
                            abort_flag = 1;
                            break;
                        }
                    }
                }
                if (abort_flag) break;
            }
            store16(dst + off, make_uint4(a.x, a.z, c.x, c.z), hi - off);
        }
    }
    __syncthreads();
    if (abort_flag) return;
    // Every GPU (the root too) tells every other GPU it is done with this op, so whichever GPU
    // is root GPUCAST_PACKET_SLOTS ops later may reuse the slot.
    if (t < p.nranks && t != p.rank) {
        st_release(signal_of(p, t) + GPUCAST_PACKET_ACK + b * GPUCAST_MAX_GPUS + p.rank, seq);
    }
    if (t == 0) st_volatile(mine + GPUCAST_PACKET_SEQ + b, seq);
}

// ---------------------------------------------------------------------------------------------
// Pull protocol (medium messages). The root announces its arrival at op k to each peer; a peer
// block waits for it (the root's stream has reached this op, so its input is ready), copies its
// share of the root's buffer into its own output, and tells the root it is done. The root block
// waits for all peers before it ends, so later work on the root's stream cannot overwrite the
// source while a peer still reads it.

template <typename W>
__device__ __forceinline__ void copy_units(const W* s, W* d, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        W a = s[i], b = s[i + stride], c = s[i + 2 * stride], e = s[i + 3 * stride];
        d[i] = a;
        d[i + stride] = b;
        d[i + 2 * stride] = c;
        d[i + 3 * stride] = e;
    }
    for (; i < n; i += stride) d[i] = s[i];
}

// Copies `bytes` bytes with the whole grid: `head` bytes one at a time, then `unit`-wide
// accesses (both addresses are aligned to `unit` after the head), then the tail one at a time.
__device__ void copy_bytes(u64 src_addr, u64 dst_addr, u64 bytes, u32 unit, u32 head) {
    const unsigned char* s = (const unsigned char*)src_addr;
    unsigned char* d = (unsigned char*)dst_addr;
    const u64 n = (bytes - head) / unit;
    const u64 tail_start = head + n * unit;
    const u32 tail = (u32)(bytes - tail_start);
    if (blockIdx.x == 0 && threadIdx.x < head) d[threadIdx.x] = s[threadIdx.x];
    if (blockIdx.x == gridDim.x - 1 && threadIdx.x < tail)
        d[tail_start + threadIdx.x] = s[tail_start + threadIdx.x];
    s += head;
    d += head;
    switch (unit) {
        case 16: copy_units((const uint4*)s, (uint4*)d, n); break;
        case 8: copy_units((const u64*)s, (u64*)d, n); break;
        case 4: copy_units((const u32*)s, (u32*)d, n); break;
        case 2: copy_units((const unsigned short*)s, (unsigned short*)d, n); break;
        default: copy_units(s, d, n); break;
    }
}

// The pull protocol around a copy: `copy` runs on the root (its own output, unless in place) and
// on every peer (reading the root's memory) between the arrival and done flags.
template <typename Copy>
__device__ __forceinline__ void pull_protocol(u64* signal, u64 error_slot, u64 timeout_ns, u32 rank,
                                              u32 nranks, u32 root, Copy copy) {
    __shared__ int abort_flag;
    __shared__ u32 s_seq;
    const u32 b = blockIdx.x;
    const u32 t = threadIdx.x;
    u32* mine = (u32*)signal[rank];
    const Bound p = {error_slot, timeout_ns};
    if (t == 0) {
        abort_flag = 0;
        s_seq = ld_volatile(mine + GPUCAST_PULL_SEQ + b) + 1;
    }
    __syncthreads();
    const u32 seq = s_seq;

    if (rank == root) {
        if (t < nranks && t != rank) {
            st_release((u32*)signal[t] + GPUCAST_ARRIVE + b * GPUCAST_MAX_GPUS + rank, seq);
        }
        copy(true);
        if (t < nranks && t != rank) {
            wait_flag(mine + GPUCAST_DONE + b * GPUCAST_MAX_GPUS + t, seq, p, PHASE_PULL_DONE, seq,
                      &abort_flag);
        }
    } else {
        if (t == 0) {
            wait_flag(mine + GPUCAST_ARRIVE + b * GPUCAST_MAX_GPUS + root, seq, p, PHASE_PULL_ARRIVE,
                      seq, &abort_flag);
        }
        __syncthreads();
        if (abort_flag) return;
        copy(false);
        __syncthreads();
        if (t == 0) st_release((u32*)signal[root] + GPUCAST_DONE + b * GPUCAST_MAX_GPUS + rank, seq);
    }
    __syncthreads();
    if (abort_flag) return;
    if (t == 0) st_volatile(mine + GPUCAST_PULL_SEQ + b, seq);
}

extern "C" __global__ void __launch_bounds__(GPUCAST_THREADS) gpucast_pull(const Params p) {
    pull_protocol((u64*)p.signal, p.error_slot, p.timeout_ns, p.rank, p.nranks, p.root,
                  [&](bool is_root) {
                      if (!is_root || p.dst != p.src) copy_bytes(p.src, p.dst, p.bytes, p.unit, p.head);
                  });
}

// Fused form: one pull protocol around a list of copies (many tensors of one broadcast).
struct ListEntry {
    u64 src;
    u64 dst;
    u64 bytes;
    u32 unit;
    u32 head;
};

struct ListParams {
    u64 signal[GPUCAST_MAX_GPUS];
    u64 error_slot;
    u64 timeout_ns;
    u32 rank;
    u32 nranks;
    u32 root;
    u32 count;
    ListEntry entries[GPUCAST_LIST_MAX];
};

extern "C" __global__ void __launch_bounds__(GPUCAST_THREADS) gpucast_pull_list(const ListParams p) {
    pull_protocol((u64*)p.signal, p.error_slot, p.timeout_ns, p.rank, p.nranks, p.root,
                  [&](bool is_root) {
                      for (u32 i = 0; i < p.count; i++) {
                          const ListEntry& e = p.entries[i];
                          if (!is_root || e.dst != e.src) copy_bytes(e.src, e.dst, e.bytes, e.unit, e.head);
                      }
                  });
}
