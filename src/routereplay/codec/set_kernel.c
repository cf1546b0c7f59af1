/* routereplay.codec._set_kernel: the set codec's row loops in C, on blocks of rows.
 *
 * Built at install from this file (setup.py, optional: where no C compiler or Python headers exist the
 * build is skipped and `routereplay.codec.native` reports the kernel missing; the numpy paths of
 * rows.py / ranker.py / subsets.py are then used, and they are the reference the kernel is tested
 * against). Bytes are the format's (routereplay.codec.blob): nothing here defines the format.
 *
 * rank_pack(experts, E, table, network, bits, bitmap, stream) -> (routed, bad_row)
 *     experts: C-contiguous (R, K) ids, any integer format; each row is validated (ids in [-1, E), a row
 *     either all -1 or K distinct ids) while it is sorted and ranked: rank = sum_i table[i + 1][c_i] over
 *     its sorted ids c_0 < ... < c_{K-1}. Routed rows set their bit in `bitmap` (zeroed by the caller,
 *     ceil(R / 8) bytes, little-endian bit order) and append their rank of `bits` bits to `stream`
 *     (LSB first). `bad_row` is the first invalid row (-1: none); encoding stops there, and the caller
 *     names the fault with the full validation catalogue.
 * unrank(payload, bitmap_bytes, stream_offset, first, R, K, bits, count, columns, out, itemsize) -> bad
 *     The inverse, with the numpy unranker's `FloatColumn` tables, one per column K - 1 .. 1 in that order
 *     (padded to powers of two), column 0 being what is left:
 *     rows whose bitmap bit is 0 (when bitmap_bytes > 0) get -1; the other rows take routed rows first,
 *     first + 1, ... of the stream at `stream_offset`: each rank is read, checked below `count` and
 *     unranked into `out` (C-contiguous (R, K) int16 or int32). `bad` is -1, or the routed row (counted
 *     from `first`) whose rank is >= count, or -2 when the stream ends first.
 *
 * Every typed buffer (experts, table, network, out, the column tables) must sit at an address that is a
 * multiple of its item size: a misaligned one (a numpy view at an odd byte offset, torch.frombuffer(...,
 * offset=1)) is refused with ValueError before any row is read, since reading int16 / int64 through a
 * misaligned pointer is undefined behaviour in C. `routereplay.codec.native` copies misaligned inputs
 * to aligned memory before they come here, and its callers refuse a misaligned `out=` by name.
 *
 * Rows are taken BLOCK_ROWS at a time as K int16 columns (E <= 32767; SSE2 8 x 8 transposes for top-8
 * int16 rows), so the sorting network's min/max and the validity checks run as vector loops over a
 * block; the table reads and the bit writes are per row. No state outlives a call; the GIL is
 * released while rows are walked.
 * Legend: R = rows, K = top-k, E = experts, m = rows of one block.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLOCK_ROWS 256
#define ALIGNED(BUF, SIZE) ((uintptr_t)(BUF) % (uintptr_t)(SIZE) == 0)
#define MAX_K 64
#define MAX_COLUMNS 64

/* ---- encode ---------------------------------------------------------------------------------------- */

/* Copy one block of rows into int16 columns, flagging ids outside [-1, E) (which would not survive
 * the int16 copy) per row. */
#define LOAD_BLOCK(NAME, T, OUT_OF_RANGE)                                                                  \
    static void NAME(const void *base, Py_ssize_t first, int m, int K, int64_t E, int16_t *cols,           \
                     uint8_t *bad) {                                                                       \
        const T *src = (const T *)base + first * K;                                                        \
        for (int j = 0; j < m; j++) {                                                                      \
            uint8_t flag = 0;                                                                              \
            for (int i = 0; i < K; i++) {                                                                  \
                T v = src[(Py_ssize_t)j * K + i];                                                          \
                flag |= (uint8_t)(OUT_OF_RANGE);                                                           \
                cols[i * BLOCK_ROWS + j] = (int16_t)v;                                                     \
            }                                                                                              \
            bad[j] = flag;                                                                                 \
        }                                                                                                  \
    }

LOAD_BLOCK(load_i8, int8_t, (v < -1) | ((int64_t)v >= E))
LOAD_BLOCK(load_u8, uint8_t, ((int64_t)v >= E))
LOAD_BLOCK(load_i16, int16_t, (v < -1) | ((int64_t)v >= E))
LOAD_BLOCK(load_u16, uint16_t, ((int64_t)v >= E))
LOAD_BLOCK(load_i32, int32_t, (v < -1) | ((int64_t)v >= E))
LOAD_BLOCK(load_u32, uint32_t, ((int64_t)v >= E))
LOAD_BLOCK(load_i64, int64_t, (v < -1) | (v >= E))
LOAD_BLOCK(load_u64, uint64_t, (v >= (uint64_t)E))

typedef void (*load_fn)(const void *, Py_ssize_t, int, int, int64_t, int16_t *, uint8_t *);

#if defined(__SSE2__)
#include <emmintrin.h>
/* int16 rows of K = 8 (one 16-byte vector a row): 8 x 8 blocks transposed with unpacks, then the range
 * check as a vector loop over the columns. The common case (top-8 routes in a trace's int16). */
static void load_i16_k8(const void *base, Py_ssize_t first, int m, int K, int64_t E, int16_t *cols, uint8_t *bad) {
    const int16_t *src = (const int16_t *)base + first * 8;
    int j = 0;
    (void)K;
    for (; j + 8 <= m; j += 8) {
        const __m128i *row = (const __m128i *)(src + (Py_ssize_t)j * 8);
        __m128i r0 = _mm_loadu_si128(row), r1 = _mm_loadu_si128(row + 1), r2 = _mm_loadu_si128(row + 2);
        __m128i r3 = _mm_loadu_si128(row + 3), r4 = _mm_loadu_si128(row + 4), r5 = _mm_loadu_si128(row + 5);
        __m128i r6 = _mm_loadu_si128(row + 6), r7 = _mm_loadu_si128(row + 7);
        __m128i t0 = _mm_unpacklo_epi16(r0, r1), t1 = _mm_unpackhi_epi16(r0, r1);
        __m128i t2 = _mm_unpacklo_epi16(r2, r3), t3 = _mm_unpackhi_epi16(r2, r3);
        __m128i t4 = _mm_unpacklo_epi16(r4, r5), t5 = _mm_unpackhi_epi16(r4, r5);
        __m128i t6 = _mm_unpacklo_epi16(r6, r7), t7 = _mm_unpackhi_epi16(r6, r7);
        __m128i u0 = _mm_unpacklo_epi32(t0, t2), u1 = _mm_unpackhi_epi32(t0, t2);
        __m128i u2 = _mm_unpacklo_epi32(t1, t3), u3 = _mm_unpackhi_epi32(t1, t3);
        __m128i u4 = _mm_unpacklo_epi32(t4, t6), u5 = _mm_unpackhi_epi32(t4, t6);
        __m128i u6 = _mm_unpacklo_epi32(t5, t7), u7 = _mm_unpackhi_epi32(t5, t7);
        _mm_storeu_si128((__m128i *)(cols + 0 * BLOCK_ROWS + j), _mm_unpacklo_epi64(u0, u4));
        _mm_storeu_si128((__m128i *)(cols + 1 * BLOCK_ROWS + j), _mm_unpackhi_epi64(u0, u4));
        _mm_storeu_si128((__m128i *)(cols + 2 * BLOCK_ROWS + j), _mm_unpacklo_epi64(u1, u5));
        _mm_storeu_si128((__m128i *)(cols + 3 * BLOCK_ROWS + j), _mm_unpackhi_epi64(u1, u5));
        _mm_storeu_si128((__m128i *)(cols + 4 * BLOCK_ROWS + j), _mm_unpacklo_epi64(u2, u6));
        _mm_storeu_si128((__m128i *)(cols + 5 * BLOCK_ROWS + j), _mm_unpackhi_epi64(u2, u6));
        _mm_storeu_si128((__m128i *)(cols + 6 * BLOCK_ROWS + j), _mm_unpacklo_epi64(u3, u7));
        _mm_storeu_si128((__m128i *)(cols + 7 * BLOCK_ROWS + j), _mm_unpackhi_epi64(u3, u7));
    }
    for (; j < m; j++)
        for (int i = 0; i < 8; i++) cols[i * BLOCK_ROWS + j] = src[(Py_ssize_t)j * 8 + i];
    for (j = 0; j < m; j++) bad[j] = 0;
    int16_t top = (int16_t)(E - 1);
    for (int i = 0; i < 8; i++) {
        const int16_t *column = cols + i * BLOCK_ROWS;
        for (j = 0; j < m; j++) bad[j] |= (uint8_t)((column[j] < -1) | (column[j] > top));
    }
}
#define HAVE_LOAD_I16_K8 1
#endif

/* The loader for a buffer's struct format and item size (native byte order only), or NULL. */
static load_fn loader_for(const char *format, Py_ssize_t itemsize) {
    char code = format ? format[0] : 'B';
    if (code == '@' || code == '=' || code == '<') code = format[1];
    int is_signed = (code == 'b' || code == 'h' || code == 'i' || code == 'l' || code == 'q' || code == 'n');
    int is_unsigned = (code == 'B' || code == 'H' || code == 'I' || code == 'L' || code == 'Q' || code == 'N');
    if (!is_signed && !is_unsigned) return NULL;
    switch (itemsize) {
    case 1: return is_signed ? load_i8 : load_u8;
    case 2: return is_signed ? load_i16 : load_u16;
    case 4: return is_signed ? load_i32 : load_u32;
    case 8: return is_signed ? load_i64 : load_u64;
    default: return NULL;
    }
}

typedef struct {
    uint8_t *out;   /* next whole word's place */
    uint64_t acc;   /* bits not yet stored, from bit 0 */
    int fill;       /* how many */
} BitWriter;

static inline void put_bits(BitWriter *w, uint64_t value, int bits) {
    w->acc |= value << w->fill;
    w->fill += bits;
    if (w->fill >= 64) {
        memcpy(w->out, &w->acc, 8);
        w->out += 8;
        w->fill -= 64;
        w->acc = w->fill ? value >> (bits - w->fill) : 0;
    }
}

static void flush_bits(BitWriter *w) {
    memcpy(w->out, &w->acc, (size_t)((w->fill + 7) / 8));
}

/* Walk every row; returns the first bad row or -1, and the routed rows written in *routed. */
static Py_ssize_t rank_pack_rows(load_fn load, const void *experts, Py_ssize_t R, int K, int64_t E,
                                 const uint64_t *table, const int32_t *network, int comparators, int bits,
                                 uint8_t *bitmap, uint8_t *stream, Py_ssize_t *routed) {
    int16_t cols[MAX_K * BLOCK_ROWS];
    uint8_t bad[BLOCK_ROWS], order[BLOCK_ROWS];
    BitWriter w = {stream, 0, 0};
    Py_ssize_t n = 0;
    for (Py_ssize_t s = 0; s < R; s += BLOCK_ROWS) {
        int m = (int)((R - s) < BLOCK_ROWS ? (R - s) : BLOCK_ROWS);
        load(experts, s, m, K, E, cols, bad);
        for (int c = 0; c < comparators; c++) { /* vector loops: column a takes the min, b the max */
            int16_t *a = cols + network[2 * c] * BLOCK_ROWS, *b = cols + network[2 * c + 1] * BLOCK_ROWS;
            for (int j = 0; j < m; j++) {
                int16_t lo = a[j] < b[j] ? a[j] : b[j], hi = a[j] < b[j] ? b[j] : a[j];
                a[j] = lo;
                b[j] = hi;
            }
        }
        for (int j = 0; j < m; j++) order[j] = 0; /* 1: some id repeats or does not increase */
        for (int i = 0; i + 1 < K; i++) {
            const int16_t *lo = cols + i * BLOCK_ROWS, *hi = lo + BLOCK_ROWS;
            for (int j = 0; j < m; j++) order[j] |= (uint8_t)(lo[j] >= hi[j]);
        }
        const int16_t *first = cols, *last = cols + (K - 1) * BLOCK_ROWS;
        for (int j = 0; j < m; j++) {
            /* ids are in [-1, E) unless bad[j]: a row whose least id is -1 is unrouted, and must be all -1 */
            int unrouted = first[j] < 0;
            if (bad[j] || (unrouted ? last[j] != -1 : order[j])) {
                *routed = n;
                return s + j;
            }
            if (unrouted) continue;
            uint64_t rank = 0;
            for (int i = 0; i < K; i++) rank += table[(Py_ssize_t)(i + 1) * E + cols[i * BLOCK_ROWS + j]];
            Py_ssize_t r = s + j;
            bitmap[r >> 3] |= (uint8_t)(1u << (r & 7));
            if (bits) put_bits(&w, rank, bits);
            n++;
        }
    }
    flush_bits(&w);
    *routed = n;
    return -1;
}

/* The real entry point: experts needs its format, so it is taken with PyObject_GetBuffer. */
static PyObject *rank_pack_entry(PyObject *self, PyObject *args) {
    PyObject *experts_obj;
    Py_buffer experts = {0}, table = {0}, network = {0}, bitmap = {0}, stream = {0};
    long long num_experts;
    int bits;
    PyObject *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "OLy*y*iw*w*", &experts_obj, &num_experts, &table, &network, &bits, &bitmap,
                          &stream))
        return NULL;
    if (PyObject_GetBuffer(experts_obj, &experts, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND) < 0) goto done;
    if (experts.ndim != 2) {
        PyErr_SetString(PyExc_ValueError, "experts must be a 2-d (rows, top_k) array");
        goto done;
    }
    Py_ssize_t R = experts.shape[0], K = experts.shape[1];
    load_fn load = loader_for(experts.format, experts.itemsize);
#ifdef HAVE_LOAD_I16_K8
    if (load == load_i16 && K == 8) load = load_i16_k8;
#endif
    if (!load) {
        PyErr_Format(PyExc_TypeError, "experts must hold integers, got format %s", experts.format);
        goto done;
    }
    if (!ALIGNED(experts.buf, experts.itemsize) || !ALIGNED(table.buf, 8) || !ALIGNED(network.buf, 4)) {
        PyErr_SetString(PyExc_ValueError, "rank_pack: experts, table or network is not aligned to its item size");
        goto done;
    }
    if (K < 1 || K > MAX_K || num_experts < 1 || num_experts > INT16_MAX || bits < 0 || bits > 64) {
        PyErr_SetString(PyExc_ValueError, "rank_pack needs 1 <= K <= 64, 1 <= E <= 32767, 0 <= bits <= 64");
        goto done;
    }
    if (table.len != (Py_ssize_t)(8 * (K + 1) * num_experts) || network.len % 8 ||
        bitmap.len < (R + 7) / 8 || stream.len < (R * bits + 7) / 8) {
        PyErr_SetString(PyExc_ValueError, "rank_pack: table, network, bitmap or stream has the wrong size");
        goto done;
    }
    int comparators = (int)(network.len / 8);
    const int32_t *pairs = (const int32_t *)network.buf;
    for (int c = 0; c < 2 * comparators; c++) {
        if (pairs[c] < 0 || pairs[c] >= K) {
            PyErr_SetString(PyExc_ValueError, "rank_pack: a comparator names a column outside [0, K)");
            goto done;
        }
    }
    Py_ssize_t routed = 0, bad;
    Py_BEGIN_ALLOW_THREADS
    bad = rank_pack_rows(load, experts.buf, R, (int)K, (int64_t)num_experts, (const uint64_t *)table.buf, pairs,
                         comparators, bits, (uint8_t *)bitmap.buf, (uint8_t *)stream.buf, &routed);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("nn", routed, bad);
done:
    if (experts.obj) PyBuffer_Release(&experts);
    PyBuffer_Release(&table);
    PyBuffer_Release(&network);
    PyBuffer_Release(&bitmap);
    PyBuffer_Release(&stream);
    return result;
}

/* ---- decode ---------------------------------------------------------------------------------------- */

typedef struct {       /* one `FloatColumn` of the numpy unranker */
    int column;        /* which id of a row it finds */
    int64_t shift, base;
    const int64_t *candidate; /* per bucket */
    const double *threshold;  /* per bucket */
    Py_ssize_t buckets;
    const double *values;     /* C(c, column + 1) per id c */
    Py_ssize_t ids;
    Py_buffer views[3];
} Column;

static inline uint64_t get_bits(const uint8_t *stream, Py_ssize_t length, Py_ssize_t position, int bits) {
    Py_ssize_t byte = position >> 3;
    int skip = (int)(position & 7);
    uint64_t word = 0;
    if (byte + 8 <= length) {
        memcpy(&word, stream + byte, 8);
    } else {
        memcpy(&word, stream + byte, (size_t)(length - byte));
    }
    uint64_t value = word >> skip;
    if (skip + bits > 64) value |= (uint64_t)stream[byte + 8] << (64 - skip);
    return bits == 64 ? value : value & ((UINT64_C(1) << bits) - 1);
}

/* Returns the first routed index whose rank is >= count, -2 when the stream ends before the bitmap's
 * routed rows do, else -1. One copy per output type. */
#define UNRANK_ROWS(NAME, OUT_T)                                                                           \
    static Py_ssize_t NAME(const uint8_t *payload, Py_ssize_t payload_len, Py_ssize_t bitmap_bytes,        \
                           Py_ssize_t stream_offset, Py_ssize_t first, Py_ssize_t R, int K, int bits,     \
                           uint64_t count, const Column *columns, int ncolumns, OUT_T *out) {               \
        double r[BLOCK_ROWS];                                                                              \
        Py_ssize_t where[BLOCK_ROWS]; /* each routed row's number */                                       \
        const uint8_t *stream = payload + stream_offset;                                                   \
        Py_ssize_t stream_len = payload_len - stream_offset, routed = first;                               \
        Py_ssize_t routed_max = bits ? (stream_len * 8) / bits : R;                                        \
        for (Py_ssize_t s = 0; s < R; s += BLOCK_ROWS) {                                                   \
            int m = (int)((R - s) < BLOCK_ROWS ? (R - s) : BLOCK_ROWS), n = 0;                             \
            if (!bitmap_bytes && bits && bits <= 56 && routed + m <= routed_max &&                         \
                ((routed + m) * bits) / 8 + 8 <= stream_len) {                                             \
                /* every row routed and the block's words inside the stream: one 8-byte read a rank */    \
                uint64_t mask = (UINT64_C(1) << bits) - 1, above = 0;                                      \
                for (int j = 0; j < m; j++) {                                                              \
                    Py_ssize_t position = (routed + j) * bits;                                             \
                    uint64_t word;                                                                         \
                    memcpy(&word, stream + (position >> 3), 8);                                            \
                    uint64_t rank = (word >> (position & 7)) & mask;                                       \
                    above |= (uint64_t)(rank >= count);                                                    \
                    r[j] = (double)rank + 1.0;                                                             \
                    where[j] = s + j;                                                                      \
                }                                                                                          \
                if (above) {                                                                               \
                    for (int j = 0; j < m; j++)                                                            \
                        if (get_bits(stream, stream_len, (routed + j) * bits, bits) >= count)              \
                            return routed + j - first;                                                     \
                }                                                                                          \
                n = m;                                                                                     \
                routed += m;                                                                               \
                m = 0; /* the general loop below has nothing left to read */                               \
            }                                                                                              \
            for (int j = 0; j < m; j++) {                                                                  \
                Py_ssize_t row = s + j;                                                                    \
                if (bitmap_bytes && !((payload[row >> 3] >> (row & 7)) & 1)) {                             \
                    for (int i = 0; i < K; i++) out[row * K + i] = -1;                                     \
                    continue;                                                                              \
                }                                                                                          \
                if (routed >= routed_max) return -2;                                                       \
                uint64_t rank = bits ? get_bits(stream, stream_len, routed * bits, bits) : 0;              \
                if (rank >= count) return routed - first;                                                  \
                r[n] = (double)rank + 1.0; /* exact: the float columns see ranks below 2**53 */            \
                where[n++] = row;                                                                          \
                routed++;                                                                                  \
            }                                                                                              \
            for (int q = 0; q < ncolumns; q++) {                                                           \
                const Column *c = columns + q;                                                             \
                const int64_t *candidate = c->candidate;                                                   \
                const double *threshold = c->threshold, *values = c->values;                               \
                int64_t shift = c->shift, base = c->base;                                                  \
                int64_t bucket_mask = c->buckets - 1, id_mask = c->ids - 1;                                \
                OUT_T *column = out + c->column;                                                           \
                for (int j = 0; j < n; j++) {                                                              \
                    int64_t word;                                                                          \
                    memcpy(&word, &r[j], 8);                                                               \
                    int64_t b = ((word >> shift) - base) & bucket_mask;                                    \
                    int64_t id = (candidate[b] + (threshold[b] <= r[j])) & id_mask;                        \
                    r[j] -= values[id];                                                                    \
                    column[where[j] * K] = (OUT_T)id;                                                      \
                }                                                                                          \
            }                                                                                              \
            for (int j = 0; j < n; j++) /* C(c, 1) = c: what is left is id 0 */                            \
                out[where[j] * K] = (OUT_T)(int64_t)(r[j] - 1.0);                                          \
        }                                                                                                  \
        return -1;                                                                                         \
    }

UNRANK_ROWS(unrank_rows_int16, int16_t)
UNRANK_ROWS(unrank_rows_int32, int32_t)

static void release_columns(Column *columns, int n) {
    for (int q = 0; q < n; q++)
        for (int v = 0; v < 3; v++) PyBuffer_Release(&columns[q].views[v]);
}

static PyObject *unrank_entry(PyObject *self, PyObject *args) {
    Py_buffer payload = {0}, out = {0};
    Py_ssize_t bitmap_bytes, stream_offset, first, R;
    int K, bits, itemsize, ncolumns = 0;
    unsigned long long count;
    PyObject *column_list, *result = NULL;
    Column columns[MAX_COLUMNS];
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnnniiKO!w*i", &payload, &bitmap_bytes, &stream_offset, &first, &R, &K, &bits,
                          &count, &PyList_Type, &column_list, &out, &itemsize))
        return NULL;
    if (K < 1 || K > MAX_K || bits < 0 || bits > 64 || (itemsize != 2 && itemsize != 4) || R < 0 ||
        out.len != R * K * itemsize || bitmap_bytes < 0 || bitmap_bytes > payload.len || stream_offset < 0 ||
        first < 0 || stream_offset > payload.len || (bitmap_bytes && bitmap_bytes < (R + 7) / 8) ||
        count > (UINT64_C(1) << 53) || PyList_GET_SIZE(column_list) != K - 1) {
        PyErr_SetString(PyExc_ValueError, "unrank: arguments out of range");
        goto done;
    }
    if (!ALIGNED(out.buf, itemsize)) {
        PyErr_SetString(PyExc_ValueError, "unrank: out is not aligned to its item size");
        goto done;
    }
    for (Py_ssize_t q = 0; q < PyList_GET_SIZE(column_list); q++) {
        Column *c = columns + q;
        memset(c, 0, sizeof(*c));
        if (!PyArg_ParseTuple(PyList_GET_ITEM(column_list, q), "iLLy*y*y*", &c->column, &c->shift, &c->base,
                              &c->views[0], &c->views[1], &c->views[2]))
            goto done;
        ncolumns++;
        c->candidate = (const int64_t *)c->views[0].buf;
        c->buckets = c->views[0].len / 8;
        c->threshold = (const double *)c->views[1].buf;
        c->values = (const double *)c->views[2].buf;
        c->ids = c->views[2].len / 8;
        if (c->column != K - 1 - q || c->views[1].len != c->views[0].len || c->buckets < 1 || c->ids < 1 ||
            (c->buckets & (c->buckets - 1)) || (c->ids & (c->ids - 1)) || c->shift < 0 || c->shift > 63 ||
            !ALIGNED(c->candidate, 8) || !ALIGNED(c->threshold, 8) || !ALIGNED(c->values, 8)) {
            PyErr_SetString(PyExc_ValueError, "unrank: a column table is malformed");
            goto done;
        }
    }
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    if (itemsize == 2)
        bad = unrank_rows_int16((const uint8_t *)payload.buf, payload.len, bitmap_bytes, stream_offset, first, R, K, bits,
                                (uint64_t)count, columns, ncolumns, (int16_t *)out.buf);
    else
        bad = unrank_rows_int32((const uint8_t *)payload.buf, payload.len, bitmap_bytes, stream_offset, first, R, K, bits,
                                (uint64_t)count, columns, ncolumns, (int32_t *)out.buf);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(bad);
done:
    release_columns(columns, ncolumns);
    PyBuffer_Release(&payload);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"rank_pack", rank_pack_entry, METH_VARARGS, "Validate, rank and bit-pack rows of expert ids (see the module)."},
    {"unrank", unrank_entry, METH_VARARGS, "Read, check and unrank a set-mode payload into rows (see the module)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_set_kernel", "The set codec's row loops in C.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__set_kernel(void) { return PyModule_Create(&module); }
