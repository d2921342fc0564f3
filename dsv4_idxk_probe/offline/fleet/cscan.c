/* The fleet engine's native line pass (docs/fleet.md, "The native pass").
 *
 * One pass over a chunk of a room log (complete lines; the last may lack its newline when
 * `final`): per line the xxh64 checksum, the byte-for-byte canonical split (the line is the
 * writer's `encode_line` output for a plain room record, key order and spelling included),
 * the fields the fleet engine keeps, the digest's 64-bit hash and, for a prefill digest,
 * the checks `pack_digest` makes. Canonical room records become compact rows; every other
 * line whose checksum holds is *odd* (the reference reads it). A line that fails its
 * checksum, an empty or short line, or a line over the reader's bound make the file *slow*
 * (status 1), except a failing last line without newline (status 2: the caller asks
 * `is_torn_tail`). The pass itself runs without the GIL.
 *
 * xxh64 is written from its public specification (seed 0), tested against `xxhash`.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#if defined(__GLIBC__)
#include <locale.h>
#define HAVE_STRTOD_L 1
static locale_t c_locale;  /* strtod_l in the C locale: correctly rounded, whatever setlocale says */
#endif

/* ---- xxh64 ---------------------------------------------------------------------------- */

#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define P4 0x85EBCA77C2B2AE63ULL
#define P5 0x27D4EB2F165667C5ULL

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }  /* little-endian hosts */
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t xround(uint64_t acc, uint64_t lane) { acc += lane * P2; acc = rotl64(acc, 31); return acc * P1; }
static inline uint64_t xmerge(uint64_t acc, uint64_t v) { acc ^= xround(0, v); return acc * P1 + P4; }

static uint64_t xxh64(const uint8_t *p, size_t len)
{
    const uint8_t *end = p + len;
    uint64_t acc;
    if (len >= 32) {
        uint64_t v1 = P1 + P2, v2 = P2, v3 = 0, v4 = (uint64_t)0 - P1;
        const uint8_t *limit = end - 32;
        do {
            v1 = xround(v1, rd64(p)); v2 = xround(v2, rd64(p + 8));
            v3 = xround(v3, rd64(p + 16)); v4 = xround(v4, rd64(p + 24));
            p += 32;
        } while (p <= limit);
        acc = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        acc = xmerge(acc, v1); acc = xmerge(acc, v2); acc = xmerge(acc, v3); acc = xmerge(acc, v4);
    } else {
        acc = P5;
    }
    acc += (uint64_t)len;
    while (p + 8 <= end) { acc ^= xround(0, rd64(p)); acc = rotl64(acc, 27) * P1 + P4; p += 8; }
    if (p + 4 <= end) { acc ^= (uint64_t)rd32(p) * P1; acc = rotl64(acc, 23) * P2 + P3; p += 4; }
    while (p < end) { acc ^= (uint64_t)(*p) * P5; acc = rotl64(acc, 11) * P1; p++; }
    acc ^= acc >> 33; acc *= P2; acc ^= acc >> 29; acc *= P3; acc ^= acc >> 32;
    return acc;
}

/* ---- vocabulary (set once from Python: vocabulary.STAGES, VERDICTS) ----------------------- */

#define MAX_WORDS 16
static char *stages[MAX_WORDS], *verdicts[MAX_WORDS];
static Py_ssize_t stage_len[MAX_WORDS], verdict_len[MAX_WORDS];
static int n_stages = 0, n_verdicts = 0;
static long long max_line_bytes = 8LL << 20;

/* ---- the canonical split -------------------------------------------------------------- */

typedef struct { const uint8_t *p, *end; } Cur;

#define SUFFIX_LEN 24  /* ,"h":"<16 hex>"} */
#define MAX_DEPTH 64
#define MAX_FAST_SEGMENTS 8
#define MAX_NAME_CHARS 256  /* validation.MAX_ROOM_CHARS: an instance or segment name over it is a bad line */
#define MAX_RID_CHARS 256  /* ridcap.MAX_RID_CHARS */

/* a literal of constant length: inlined, so the compiler compares it in a few wide loads
 * instead of calling memcmp for every key of every line */
#define LIT(c, s)                                                                                   \
    ((size_t)((c)->end - (c)->p) >= sizeof(s) - 1 && __builtin_memcmp((c)->p, (s), sizeof(s) - 1) == 0 \
         ? ((c)->p += sizeof(s) - 1, 1) : 0)

static inline int ch(Cur *c, char x)
{
    if (c->p >= c->end || *c->p != (uint8_t)x) return 0;
    c->p++;
    return 1;
}
#define CH(c, x) ch((c), (x))

/* byte classes: 1 plain (printable ASCII, no quote nor backslash), 2 lowercase hex digit */
static uint8_t cls[256];

static void init_classes(void)
{
    for (int b = 0x20; b <= 0x7E; b++) cls[b] = (b != '"' && b != '\\') ? 1 : 0;
    for (int b = '0'; b <= '9'; b++) cls[b] |= 2;
    for (int b = 'a'; b <= 'f'; b++) cls[b] |= 2;
}

static inline int plain(uint8_t b) { return cls[b] & 1; }

/* "..." of printable ASCII without quote or backslash (its text is its value); span out */
static int simple_str(Cur *c, const uint8_t **s, Py_ssize_t *n, int no_comma)
{
    if (c->p >= c->end || *c->p != '"') return 0;
    const uint8_t *q = c->p + 1;
    while (q < c->end && plain(*q) && !(no_comma && *q == ',')) q++;
    if (q >= c->end || *q != '"') return 0;
    *s = c->p + 1;
    *n = q - (c->p + 1);
    c->p = q + 1;
    return 1;
}

static int str_or_null(Cur *c, const uint8_t **s, Py_ssize_t *n)
{
    if (LIT(c, "null")) { *s = NULL; *n = -1; return 1; }
    return simple_str(c, s, n, 0);
}

/* an integer: 0 or [1-9][0-9]{0,maxd-1}, optionally negative */
static int integer(Cur *c, int neg_ok, int maxd, long long *out)
{
    const uint8_t *q = c->p;
    int neg = 0;
    if (neg_ok && q < c->end && *q == '-') { neg = 1; q++; }
    if (q >= c->end || *q < '0' || *q > '9') return 0;
    if (*q == '0') {
        if (neg) return 0;
        c->p = q + 1;
        *out = 0;
        return 1;
    }
    long long v = 0;
    int d = 0;
    while (q < c->end && *q >= '0' && *q <= '9') { v = v * 10 + (*q - '0'); q++; if (++d > maxd) return 0; }
    c->p = q;
    *out = neg ? -v : v;
    return 1;
}

static inline __attribute__((always_inline)) int hex16_str(Cur *c)
{
    if (c->end - c->p < 18 || c->p[0] != '"' || c->p[17] != '"') return 0;
    const uint8_t *q = c->p + 1;
#ifdef __SSE2__
    __m128i x = _mm_loadu_si128((const __m128i *)q);
    __m128i digit = _mm_and_si128(_mm_cmpgt_epi8(x, _mm_set1_epi8('0' - 1)), _mm_cmpgt_epi8(_mm_set1_epi8('9' + 1), x));
    __m128i af = _mm_and_si128(_mm_cmpgt_epi8(x, _mm_set1_epi8('a' - 1)), _mm_cmpgt_epi8(_mm_set1_epi8('f' + 1), x));
    if (_mm_movemask_epi8(_mm_or_si128(digit, af)) != 0xFFFF) return 0;
#else
    unsigned ok = 2;
    for (int i = 0; i < 16; i++) ok &= cls[q[i]];
    if (!ok) return 0;
#endif
    c->p += 18;
    return 1;
}

/* any JSON value, strictly and compactly spelled (no whitespace, plain strings): the
 * reference parses it, and its bytes are all that is hashed. */
static int skip_value(Cur *c, int depth)
{
    if (c->p >= c->end || depth > MAX_DEPTH) return 0;
    uint8_t b = *c->p;
    if (b == '"') { const uint8_t *s; Py_ssize_t n; return simple_str(c, &s, &n, 0); }
    if (b == '{') {
        c->p++;
        if (c->p < c->end && *c->p == '}') { c->p++; return 1; }
        for (;;) {
            const uint8_t *s; Py_ssize_t n;
            if (!simple_str(c, &s, &n, 0) || !CH(c, ':') || !skip_value(c, depth + 1)) return 0;
            if (CH(c, ',')) continue;
            return CH(c, '}');
        }
    }
    if (b == '[') {
        c->p++;
        if (c->p < c->end && *c->p == ']') { c->p++; return 1; }
        for (;;) {
            if (!skip_value(c, depth + 1)) return 0;
            if (CH(c, ',')) continue;
            return CH(c, ']');
        }
    }
    if (LIT(c, "null") || LIT(c, "true") || LIT(c, "false")) return 1;
    /* -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? */
    const uint8_t *q = c->p;
    if (q < c->end && *q == '-') q++;
    if (q >= c->end || *q < '0' || *q > '9') return 0;
    if (*q == '0') q++;
    else while (q < c->end && *q >= '0' && *q <= '9') q++;
    if (q < c->end && *q == '.') {
        q++;
        if (q >= c->end || *q < '0' || *q > '9') return 0;
        while (q < c->end && *q >= '0' && *q <= '9') q++;
    }
    if (q < c->end && (*q == 'e' || *q == 'E')) {
        q++;
        if (q < c->end && (*q == '+' || *q == '-')) q++;
        if (q >= c->end || *q < '0' || *q > '9') return 0;
        while (q < c->end && *q >= '0' && *q <= '9') q++;
    }
    c->p = q;
    return 1;
}

/* A prefill digest as `pack_digest` accepts it, spelled as the writer writes it:
 * {"key":K,"signature":HEX,"n_tokens":N,"layer_ids":[..],"segments":[1..8 names],
 *  "room":R,"layer_segment":[rows of len(segments) HEX],"pages":[HEX..]}, as many rows as layer ids. */
static int strict_digest(Cur *c, long long *n_tokens, long long *cells)
{
    const uint8_t *s; Py_ssize_t n;
    long long v, n_ids = 0, n_segs = 0, n_rows = 0, n_pages = 0;
    if (!LIT(c, "{\"key\":") || !simple_str(c, &s, &n, 0) || !LIT(c, ",\"signature\":") || !hex16_str(c)
        || !LIT(c, ",\"n_tokens\":") || !integer(c, 0, 12, n_tokens) || !LIT(c, ",\"layer_ids\":["))
        return 0;
    if (!CH(c, ']')) {
        for (;;) {
            if (!integer(c, 1, 18, &v)) return 0;
            n_ids++;
            if (CH(c, ',')) continue;
            if (!CH(c, ']')) return 0;
            break;
        }
    }
    if (!LIT(c, ",\"segments\":[")) return 0;
    for (;;) {
        if (!simple_str(c, &s, &n, 1) || n > MAX_NAME_CHARS) return 0;  /* a longer name: a bad line */
        if (++n_segs > MAX_FAST_SEGMENTS) return 0;
        if (CH(c, ',')) continue;
        if (!CH(c, ']')) return 0;
        break;
    }
    if (!LIT(c, ",\"room\":") || !simple_str(c, &s, &n, 0) || !LIT(c, ",\"layer_segment\":[")) return 0;
    if (!CH(c, ']')) {
        for (;;) {
            if (!CH(c, '[')) return 0;
            for (long long k = 0; k < n_segs; k++) {
                if (k && !CH(c, ',')) return 0;
                if (!hex16_str(c)) return 0;
            }
            if (!CH(c, ']')) return 0;
            n_rows++;
            if (CH(c, ',')) continue;
            if (!CH(c, ']')) return 0;
            break;
        }
    }
    if (!LIT(c, ",\"pages\":[")) return 0;
    if (!CH(c, ']')) {
        for (;;) {
            if (!hex16_str(c)) return 0;
            n_pages++;
            if (CH(c, ',')) continue;
            if (!CH(c, ']')) return 0;
            break;
        }
    }
    if (!CH(c, '}') || n_rows != n_ids) return 0;
    *cells = n_ids * n_pages;
    return 1;
}

/* one word of a vocabulary, quoted; its index or -1 */
static int word(Cur *c, char **words, Py_ssize_t *lens, int n)
{
    for (int i = 0; i < n; i++) {
        Py_ssize_t L = lens[i];
        if (c->end - c->p >= L + 2 && c->p[0] == '"' && c->p[L + 1] == '"' && memcmp(c->p + 1, words[i], L) == 0) {
            c->p += L + 2;
            return i;
        }
    }
    return -1;
}

/* exact powers of ten as doubles (up to 1e22, the last one a double holds exactly) */
static const double pow10_double[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                                      1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* ---- the `repr` proof of a 16-17 digit `ts`, in exact integer arithmetic --------------------
 *
 * Python's repr of a float x (David Gay's dtoa, mode 0) is the decimal with the fewest
 * significant digits that reads back as x (reading rounds to nearest, ties to an even
 * mantissa, so the bounds of x's rounding interval belong to x when its mantissa is even; the
 * interval is narrower below a power of two), and among those of that length the one nearest
 * x, ties to an even last digit. So a spelling D = M * 10^-k of n significant digits (no
 * trailing zero) is repr(x) for x = D correctly rounded iff
 *   (a) D lies in x's interval (this is how x is found),
 *   (b) no decimal of fewer digits does: the two multiples of 10^(1-k) around D are outside it
 *       (any shorter decimal in the interval is such a multiple, and the interval holds D,
 *       so it would hold the nearer of the two), and
 *   (c) neither n-digit neighbour (M - 1, M + 1) is in it and nearer x, or as near with D's last
 *       digit odd.
 * Every quantity is compared scaled by 10^k * 2^(2-q) (x = m * 2^q): D -> M << (2-q),
 * x -> 4 m 10^k, half a unit in the last place -> 2 * 10^k, a quarter -> 10^k: integers
 * below 2^127 for the spellings the grammar admits (k <= 20, M < 10^17, x >= 1e-4). */

#ifdef __SIZEOF_INT128__
typedef unsigned __int128 u128;
static u128 pow10_128[21];

static void init_pow10_128(void)
{
    pow10_128[0] = 1;
    for (int i = 1; i < 21; i++) pow10_128[i] = pow10_128[i - 1] * 10;
}

static inline int in_interval(u128 v, u128 lo, u128 hi, int even)
{
    return even ? (v >= lo && v <= hi) : (v > lo && v < hi);
}

static inline u128 distance(u128 a, u128 b) { return a > b ? a - b : b - a; }
#endif

/* 1: M * 10^-k (16-17 significant digits, M % 10 != 0) is repr of *value, its correctly rounded
 * double; 0: it is not; 2: outside what this proves (the caller asks Python's repr). */
static int repr_proof(uint64_t M, int k, double *value)
{
#ifdef __SIZEOF_INT128__
    if (k < 1 || k > 20 || M % 10 == 0 || M >= 100000000000000000ULL) return 2;
    double x = (double)M / pow10_double[k];  /* within a unit or two in the last place: corrected below */
    for (int tries = 0; tries < 6; tries++) {
        uint64_t bits;
        memcpy(&bits, &x, sizeof bits);
        int be = (int)(bits >> 52) & 0x7FF;
        if (be == 0 || be == 0x7FF || (bits >> 63)) return 2;  /* subnormal, inf, NaN, negative */
        uint64_t m = (bits & ((1ULL << 52) - 1)) | (1ULL << 52);
        int shift = 2 - (be - 1075);  /* 2 - q */
        if (shift < 0 || shift > 70) return 2;
        u128 P = pow10_128[k];
        u128 X = ((u128)m * P) << 2;
        u128 lo = X - (m == (1ULL << 52) && be > 1 ? P : P << 1), hi = X + (P << 1);
        int even = !(m & 1);
        u128 D = (u128)M << shift;
        if (D < lo || (D == lo && !even)) { x = nextafter(x, 0.0); continue; }
        if (D > hi || (D == hi && !even)) { x = nextafter(x, INFINITY); continue; }
        *value = x;
        uint64_t below = M - M % 10;
        if (in_interval((u128)below << shift, lo, hi, even) || in_interval((u128)(below + 10) << shift, lo, hi, even))
            return 0;
        u128 own = distance(D, X);
        for (int side = 0; side < 2; side++) {
            u128 v = (u128)(side ? M + 1 : M - 1) << shift;
            if (!in_interval(v, lo, hi, even)) continue;
            u128 d = distance(v, X);
            if (d < own || (d == own && (M & 1))) return 0;
        }
        return 1;
    }
#else
    (void)M; (void)k; (void)value;
#endif
    return 2;
}

/* A `ts` the regex admits, as the writer spells a float: Python's repr (orjson writes the
 * same), that is the shortest spelling that reads back, in fixed notation (>= 1e-4), or an
 * integer. Returns 0 (not so spelled: odd), 1 (*value exact: an integer; at most 15
 * significant digits, N / 10^k of two exact doubles in one correctly rounded division,
 * Clinger's fast path; 16-17 digits proven repr by `repr_proof`) or 2 (16-17 digits the proof
 * does not cover: *value from strtod_l where there is one, else NaN; the caller compares
 * repr(value) with the text, holding the GIL). */
static int ts_spelling(const uint8_t *p, const uint8_t *end, double *value)
{
    const uint8_t *start = p, *dot = memchr(p, '.', end - p);
    uint64_t n = 0;
    int digits = 0;
    if (!dot) {
        for (; p < end; p++) n = n * 10 + (uint64_t)(*p - '0');
        *value = (double)n;
        return 1;
    }
    const uint8_t *f = dot + 1;
    int zeros = 1;
    for (const uint8_t *q = f; q < end; q++) zeros &= *q == '0';
    if (zeros) {
        if (end - f != 1) return 0;  /* N.0 only */
        for (; p < dot; p++) n = n * 10 + (uint64_t)(*p - '0');
        *value = (double)n;
        return 1;
    }
    if (end[-1] == '0') return 0;  /* a trailing zero: not the shortest spelling */
    if (dot - start == 1 && *start == '0' && end - f >= 4 && memcmp(f, "0000", 4) == 0) return 0;  /* < 1e-4 */
    for (; p < end; p++) {
        if (p == dot) continue;
        if (n || *p != '0') digits++;
        if (digits > 17) return 0;
        n = n * 10 + (uint64_t)(*p - '0');
    }
    if (digits <= 15) {
        *value = (double)n / pow10_double[end - f];
        return 1;
    }
    int proof = repr_proof(n, (int)(end - f), value);
    if (proof != 2) return proof;
    *value = NAN;
#ifdef HAVE_STRTOD_L
    char buf[40];
    if (c_locale && end - start < (Py_ssize_t)sizeof buf) {
        memcpy(buf, start, end - start);
        buf[end - start] = 0;
        *value = strtod_l(buf, NULL, c_locale);
    }
#endif
    return 2;
}

typedef struct {
    long long line, attempt, step, tokens, cells;
    Py_ssize_t ts_off, ts_len;
    double ts;  /* NaN: null, or (ts_check) read with the GIL */
    int ts_check;  /* repr(ts) must be the text: checked with the GIL */
    uint64_t dh;
    int8_t stage, live;
    uint8_t flags;  /* 1: a digest; 2: a prefill digest pack_digest accepts */
    Py_ssize_t room_off, room_len, inst_off, inst_len, lay_off, lay_len, rid_off, rid_len;
} Row;

#define NULL_INT ((long long)INT64_MIN)

/* `ts`: null, or (0|[1-9][0-9]{0,10})(\.[0-9]{1,20})? spelled as the writer spells it; 0: odd */
static int ts_field(Cur *c, const uint8_t *base, Row *r)
{
    r->ts_check = 0;
    if (LIT(c, "null")) { r->ts_len = -1; r->ts = NAN; return 1; }
    const uint8_t *q = c->p;
    if (q >= c->end || *q < '0' || *q > '9') return 0;
    if (*q == '0') q++;
    else { int d = 0; while (q < c->end && *q >= '0' && *q <= '9') { q++; if (++d > 11) return 0; } }
    if (q < c->end && *q == '.') {
        q++;
        int d = 0;
        while (q < c->end && *q >= '0' && *q <= '9') { q++; if (++d > 20) return 0; }
        if (!d) return 0;
    }
    r->ts_off = c->p - base;
    r->ts_len = q - c->p;
    int spelled = ts_spelling(c->p, q, &r->ts);
    if (!spelled) return 0;
    r->ts_check = spelled == 2;
    c->p = q;
    return 1;
}

/* The last digest read in this chunk, with what its reading found: a room's decode records
 * follow one another and nearly always carry the same digest text, and comparing its bytes is
 * far cheaper than splitting and hashing them again. The split reads a digest's own bytes
 * only, so equal bytes read the same. */
typedef struct {
    const uint8_t *p;  /* NULL: none yet */
    Py_ssize_t n;
    uint64_t h;        /* xxh64 of the text */
    int strict;        /* the writer's digest, as `pack_digest` accepts it */
    long long n_tokens, cells;
} LastDigest;

/* The body of a line as the writer's record, from `start` (no further than `head_end`): 1 and
 * *stop where the record's members end (where its checksum member must begin), or 0 (odd).
 * Nothing the split accepts is a newline. */
static int canonical(const uint8_t *base, const uint8_t *start, const uint8_t *head_end, Row *r, LastDigest *last,
                     const uint8_t **stop)
{
    Cur c = {start, head_end};
    const uint8_t *s; Py_ssize_t n;
    long long v;
    if (!LIT(&c, "{\"v\":1,\"kind\":\"room\",\"ts\":")) return 0;
    if (!ts_field(&c, base, r)) return 0;
    if (!LIT(&c, ",\"role\":") || !str_or_null(&c, &s, &n)) return 0;
    if (!LIT(&c, ",\"instance\":") || !str_or_null(&c, &s, &n) || n > MAX_NAME_CHARS) return 0;
    r->inst_off = s ? s - base : 0; r->inst_len = n;
    if (!LIT(&c, ",\"room\":") || !simple_str(&c, &s, &n, 0) || n < 1 || n > 256) return 0;
    r->room_off = s - base; r->room_len = n;
    if (!LIT(&c, ",\"attempt\":") || !integer(&c, 0, 18, &r->attempt)) return 0;
    if (!LIT(&c, ",\"stage\":") || (r->stage = (int8_t)word(&c, stages, stage_len, n_stages)) < 0) return 0;
    if (!LIT(&c, ",\"step\":")) return 0;
    if (LIT(&c, "null")) r->step = NULL_INT;
    else if (!integer(&c, 1, 18, &r->step)) return 0;
    if (!LIT(&c, ",\"layout\":") || !str_or_null(&c, &s, &n)) return 0;
    r->lay_off = s ? s - base : 0; r->lay_len = n;
    if (!LIT(&c, ",\"digest\":")) return 0;
    r->flags = 0;
    r->tokens = NULL_INT;
    r->cells = NULL_INT;
    r->dh = 0;
    if (!LIT(&c, "null")) {
        const uint8_t *d0 = c.p;
        if (c.p >= c.end || *c.p != '{') return 0;
        if (!(last->p && c.end - c.p >= last->n && memcmp(c.p, last->p, last->n) == 0)) {
            long long nt = 0, cells = 0;
            int strict = strict_digest(&c, &nt, &cells);  /* the writer's digest: the common case, any stage */
            if (!strict) {
                c.p = d0;
                if (!skip_value(&c, 0)) return 0;
            }
            *last = (LastDigest){d0, c.p - d0, xxh64(d0, c.p - d0), strict, nt, cells};
        }
        c.p = d0 + last->n;
        r->flags = 1;
        r->dh = last->h;
        if (last->strict && r->stage == 0) {
            r->flags = 3;
            r->tokens = last->n_tokens;
            r->cells = last->cells;
        }
    }
    if (!LIT(&c, ",\"verdict\":")) return 0;
    if (LIT(&c, "null")) r->live = -1;
    else if ((r->live = (int8_t)word(&c, verdicts, verdict_len, n_verdicts)) < 0) return 0;
    if (!LIT(&c, ",\"reason\":") || !str_or_null(&c, &s, &n)) return 0;
    if (!LIT(&c, ",\"expected_room\":") || !str_or_null(&c, &s, &n)) return 0;
    if (!LIT(&c, ",\"localisation\":null,\"first_divergence\":") || !str_or_null(&c, &s, &n)) return 0;
    if (LIT(&c, ",\"tokens\":")) {
        if (!integer(&c, 0, 12, &v)) return 0;
        if (!(r->flags & 1)) r->tokens = v;
    }
    /* a longer rid is cut when read (ridcap.cap_rid): the reference reads the line */
    if (!LIT(&c, ",\"rid\":") || !str_or_null(&c, &s, &n) || n == 0 || n > MAX_RID_CHARS) return 0;
    r->rid_off = s ? s - base : 0; r->rid_len = n;
    *stop = c.p;
    return 1;
}

/* ---- the chunk ------------------------------------------------------------------------ */

static int hexval(uint8_t b) { return b >= '0' && b <= '9' ? b - '0' : (b >= 'a' && b <= 'f' ? b - 'a' + 10 : -1); }

/* the checksum member at the end of [start, end) holds; 0 if not */
static int checksum_ok(const uint8_t *start, const uint8_t *end)
{
    Py_ssize_t len = end - start;
    if (len < SUFFIX_LEN + 2) return 0;
    const uint8_t *suf = end - SUFFIX_LEN;
    if (memcmp(suf, ",\"h\":\"", 6) != 0 || end[-2] != '"' || end[-1] != '}') return 0;
    uint64_t want = 0;
    for (int i = 0; i < 16; i++) {
        int h = hexval(suf[6 + i]);
        if (h < 0) return 0;
        want = (want << 4) | (uint64_t)h;
    }
    return xxh64(start, suf - start) == want;
}

typedef struct {
    Row *rows; Py_ssize_t n_rows, cap_rows;
    long long *odd; Py_ssize_t n_odd, cap_odd;
    int status; const char *why;
    Py_ssize_t n_lines, n_valid, torn_off;
} Out;

static int push_row(Out *o, const Row *r)
{
    if (o->n_rows == o->cap_rows) {
        Py_ssize_t cap = o->cap_rows ? o->cap_rows * 2 : 4096;
        Row *nr = realloc(o->rows, cap * sizeof(Row));
        if (!nr) return 0;
        o->rows = nr; o->cap_rows = cap;
    }
    o->rows[o->n_rows++] = *r;
    return 1;
}

static int push_odd(Out *o, long long line)
{
    if (o->n_odd == o->cap_odd) {
        Py_ssize_t cap = o->cap_odd ? o->cap_odd * 2 : 256;
        long long *no = realloc(o->odd, cap * sizeof(long long));
        if (!no) return 0;
        o->odd = no; o->cap_odd = cap;
    }
    o->odd[o->n_odd++] = line;
    return 1;
}

/* Where the line ends if a checksum member begins at `he` and ends it (at a newline, or at the
 * data's end in a final chunk), else NULL. */
static const uint8_t *suffix_end(const uint8_t *he, const uint8_t *end, int final)
{
    if (end - he < SUFFIX_LEN) return NULL;
    const uint8_t *le = he + SUFFIX_LEN;
    if (le < end ? *le != '\n' : !final) return NULL;
    return memcmp(he, ",\"h\":\"", 6) == 0 && le[-2] == '"' && le[-1] == '}' ? le : NULL;
}

/* returns 0 on out-of-memory */
static int scan(const uint8_t *data, Py_ssize_t size, long long first_line, int final, Out *o)
{
    const uint8_t *p = data, *end = data + size;
    long long line = first_line;
    LastDigest last = {NULL, 0, 0, 0, 0, 0};
    while (p < end) {
        Row r;
        const uint8_t *he, *le;
        r.line = line;
        /* A canonical line needs no search for its newline: the split stops where its checksum
           member begins, and with no newline in what it accepts, the line ends after that member
           exactly when the line is canonical (as the split bounded by the newline would say). */
        if (canonical(data, p, end, &r, &last, &he) && (le = suffix_end(he, end, final)) && le - p <= max_line_bytes) {
            int tail = le == end;
            o->n_lines++;
            if (!checksum_ok(p, le)) {
                if (tail) { o->status = 2; o->torn_off = p - data; return 1; }
                o->status = 1; o->why = "a line fails its checksum"; return 1;
            }
            o->n_valid++;
            if (!push_row(o, &r)) return 0;
            line++;
            p = tail ? end : le + 1;
            continue;
        }
        const uint8_t *nl = memchr(p, '\n', end - p);
        int tail = nl == NULL;  /* the file's last line, without newline (only when final) */
        le = tail ? end : nl;
        Py_ssize_t len = le - p;
        o->n_lines++;
        if (len > max_line_bytes) { o->status = 1; o->why = "line over the reader's bound"; return 1; }
        if (len < SUFFIX_LEN + 2) {
            if (tail && final) return 1;  /* a short torn tail: dropped, as the Python scan does */
            o->status = 1; o->why = "short or empty line"; return 1;
        }
        if (!checksum_ok(p, le)) {
            if (tail && final) { o->status = 2; o->torn_off = p - data; return 1; }
            o->status = 1; o->why = "a line fails its checksum"; return 1;
        }
        o->n_valid++;
        if (canonical(data, p, le - SUFFIX_LEN, &r, &last, &he) && he == le - SUFFIX_LEN) {
            if (!push_row(o, &r)) return 0;  /* (not reached: the unbounded split above says the same) */
        }
        else if (!push_odd(o, line)) return 0;
        line++;
        p = tail ? end : nl + 1;
    }
    return 1;
}

/* a str for data[off:off+len] (None when len < 0), reusing the last one when equal */
static PyObject *text(const uint8_t *data, Py_ssize_t off, Py_ssize_t len, PyObject **last, const uint8_t **lp,
                      Py_ssize_t *ll)
{
    if (len < 0) Py_RETURN_NONE;
    if (*last && *ll == len && memcmp(*lp, data + off, len) == 0) { Py_INCREF(*last); return *last; }
    PyObject *s = PyUnicode_DecodeASCII((const char *)data + off, len, NULL);
    if (!s) return NULL;
    Py_XDECREF(*last);
    Py_INCREF(s);
    *last = s; *lp = data + off; *ll = len;
    return s;
}

/* the text of a `ts` the split accepted, as a double (NaN: null) */
static double number(const uint8_t *data, Py_ssize_t off, Py_ssize_t len)
{
    char buf[40];
    if (len < 0 || len >= (Py_ssize_t)sizeof buf) return NAN;
    memcpy(buf, data + off, len);
    buf[len] = 0;
    return PyOS_string_to_double(buf, NULL, NULL);
}

/* Rows whose ts has 16-17 digits: kept when the text is repr(ts) (the writer's spelling),
 * else their lines join the odd ones (both lists stay in line order). 0: an exception. */
static int repr_checks(const uint8_t *data, Out *o)
{
    Py_ssize_t kept = 0, n_bad = 0;
    long long *bad = NULL;
    for (Py_ssize_t i = 0; i < o->n_rows; i++) {
        Row *r = &o->rows[i];
        if (r->ts_check) {
            if (isnan(r->ts)) r->ts = number(data, r->ts_off, r->ts_len);
            if (PyErr_Occurred()) { free(bad); return 0; }
            char *text = PyOS_double_to_string(r->ts, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
            if (!text) { free(bad); return 0; }
            int same = (Py_ssize_t)strlen(text) == r->ts_len && memcmp(text, data + r->ts_off, r->ts_len) == 0;
            PyMem_Free(text);
            if (!same) {
                if (!bad && !(bad = malloc(o->n_rows * sizeof(long long)))) { PyErr_NoMemory(); return 0; }
                bad[n_bad++] = r->line;
                continue;
            }
        }
        if (kept != i) o->rows[kept] = *r;  /* rows move only behind a dropped one */
        kept++;
    }
    o->n_rows = kept;
    if (!n_bad) return 1;
    long long *merged = malloc((o->n_odd + n_bad) * sizeof(long long));
    if (!merged) { free(bad); PyErr_NoMemory(); return 0; }
    Py_ssize_t a = 0, b = 0, m = 0;
    while (a < o->n_odd || b < n_bad)
        merged[m++] = (b >= n_bad || (a < o->n_odd && o->odd[a] < bad[b])) ? o->odd[a++] : bad[b++];
    free(o->odd);
    free(bad);
    o->odd = merged;
    o->n_odd = o->cap_odd = m;
    return 1;
}

/* The rows array is kept for the thread's next chunk (one per scanning thread, never freed):
 * a fresh one per chunk costs a page fault per 4 KiB written, more than the rows' own making. */
static __thread Row *spare_rows;
static __thread Py_ssize_t spare_cap;

#define N_NUMERIC 10
static const char *numeric_names[N_NUMERIC] = {"line", "attempt", "step", "ts", "tokens", "cells", "dh", "flags",
                                               "stage", "live"};
static const Py_ssize_t numeric_width[N_NUMERIC] = {8, 8, 8, 8, 8, 8, 8, 1, 1, 1};

static PyObject *scan_chunk(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    long long first_line;
    int final;
    if (!PyArg_ParseTuple(args, "y*Lp", &buf, &first_line, &final)) return NULL;
    Out o;
    memset(&o, 0, sizeof o);
    o.rows = spare_rows, o.cap_rows = spare_cap;  /* this thread's rows array of its last chunk */
    spare_rows = NULL, spare_cap = 0;
    int ok;
    const uint8_t *data = buf.buf;
    Py_BEGIN_ALLOW_THREADS
    ok = scan(data, buf.len, first_line, final, &o);
    Py_END_ALLOW_THREADS
    PyObject *cols = NULL, *result = NULL;
    PyObject *lists[4] = {NULL, NULL, NULL, NULL};
    PyObject *numeric[N_NUMERIC] = {NULL};
    if (!ok) { PyErr_NoMemory(); goto fail; }
    if (!repr_checks(data, &o)) goto fail;
    Py_ssize_t n = o.n_rows;
    cols = PyDict_New();
    if (!cols) goto fail;
    /* the numeric columns filled in one pass over the rows, not a pass per column */
    for (int j = 0; j < N_NUMERIC; j++)
        if (!(numeric[j] = PyBytes_FromStringAndSize(NULL, n * numeric_width[j]))) goto fail;
    {
        long long *line = (long long *)PyBytes_AS_STRING(numeric[0]), *attempt = (long long *)PyBytes_AS_STRING(numeric[1]),
                  *step = (long long *)PyBytes_AS_STRING(numeric[2]), *tokens = (long long *)PyBytes_AS_STRING(numeric[4]),
                  *cells = (long long *)PyBytes_AS_STRING(numeric[5]);
        double *ts = (double *)PyBytes_AS_STRING(numeric[3]);
        uint64_t *dh = (uint64_t *)PyBytes_AS_STRING(numeric[6]);
        uint8_t *flags = (uint8_t *)PyBytes_AS_STRING(numeric[7]);
        int8_t *stage = (int8_t *)PyBytes_AS_STRING(numeric[8]), *live = (int8_t *)PyBytes_AS_STRING(numeric[9]);
        for (Py_ssize_t i = 0; i < n; i++) {
            const Row *r = &o.rows[i];
            line[i] = r->line, attempt[i] = r->attempt, step[i] = r->step, ts[i] = r->ts, tokens[i] = r->tokens;
            cells[i] = r->cells, dh[i] = r->dh, flags[i] = r->flags, stage[i] = r->stage, live[i] = r->live;
        }
    }
    for (int j = 0; j < N_NUMERIC; j++) {
        if (PyDict_SetItemString(cols, numeric_names[j], numeric[j]) < 0) goto fail;
        Py_CLEAR(numeric[j]);
    }
    {
        PyObject *last[4] = {NULL, NULL, NULL, NULL};
        const uint8_t *lp[4] = {NULL, NULL, NULL, NULL};
        Py_ssize_t ll[4] = {0, 0, 0, 0};
        for (int k = 0; k < 4; k++) if (!(lists[k] = PyList_New(n))) goto strings_fail;
        for (Py_ssize_t i = 0; i < n; i++) {
            const Row *r = &o.rows[i];
            Py_ssize_t off[4] = {r->room_off, r->inst_off, r->lay_off, r->rid_off};
            Py_ssize_t len[4] = {r->room_len, r->inst_len, r->lay_len, r->rid_len};
            for (int k = 0; k < 4; k++) {
                PyObject *s = text(data, off[k], len[k], &last[k], &lp[k], &ll[k]);
                if (!s) goto strings_fail;
                PyList_SET_ITEM(lists[k], i, s);
            }
        }
        for (int k = 0; k < 4; k++) Py_XDECREF(last[k]);
        goto strings_done;
    strings_fail:
        for (int k = 0; k < 4; k++) Py_XDECREF(last[k]);
        goto fail;
    strings_done:;
    }
    static const char *names[4] = {"room", "instance", "layout", "rid"};
    for (int k = 0; k < 4; k++) {
        if (PyDict_SetItemString(cols, names[k], lists[k]) < 0) goto fail;
        Py_CLEAR(lists[k]);
    }
    PyObject *odd = PyBytes_FromStringAndSize((const char *)o.odd, o.n_odd * sizeof(long long));
    if (!odd) goto fail;
    result = Py_BuildValue("(isnnnNN)", o.status, o.why ? o.why : "", o.n_lines, o.n_valid, o.torn_off, cols, odd);
    cols = NULL;
fail:
    for (int k = 0; k < 4; k++) Py_XDECREF(lists[k]);
    for (int j = 0; j < N_NUMERIC; j++) Py_XDECREF(numeric[j]);
    Py_XDECREF(cols);
    spare_rows = o.rows, spare_cap = o.cap_rows;
    free(o.odd);
    PyBuffer_Release(&buf);
    return result;
}

static PyObject *py_xxh64(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*", &buf)) return NULL;
    uint64_t h = xxh64(buf.buf, buf.len);
    PyBuffer_Release(&buf);
    return PyLong_FromUnsignedLongLong(h);
}

/* ts_spellings(blob): each '\n'-separated `ts` text through the split's own `ts` rule; for the
 * tests, which compare it with Python's repr on millions of values. */
static PyObject *ts_spellings(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*", &buf)) return NULL;
    const uint8_t *p = buf.buf, *end = p + buf.len;
    Py_ssize_t n = 0;
    for (const uint8_t *q = p; q < end; q++) n += *q == '\n';
    if (buf.len && end[-1] != '\n') n++;
    PyObject *status = PyBytes_FromStringAndSize(NULL, n), *values = PyBytes_FromStringAndSize(NULL, n * sizeof(double));
    if (!status || !values) { Py_XDECREF(status); Py_XDECREF(values); PyBuffer_Release(&buf); return NULL; }
    uint8_t *st = (uint8_t *)PyBytes_AS_STRING(status);
    double *val = (double *)PyBytes_AS_STRING(values);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *nl = memchr(p, '\n', end - p), *le = nl ? nl : end;
        Cur c = {p, le};
        Row r;
        r.ts = NAN;
        int ok = ts_field(&c, p, &r) && c.p == le;
        st[i] = !ok ? 0 : r.ts_check ? 2 : 1;
        val[i] = ok ? r.ts : NAN;
        p = nl ? nl + 1 : end;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return Py_BuildValue("(NN)", status, values);
}

static int set_words(PyObject *seq, char **words, Py_ssize_t *lens, int *count)
{
    PyObject *fast = PySequence_Fast(seq, "a sequence of str");
    if (!fast) return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > MAX_WORDS) { Py_DECREF(fast); PyErr_SetString(PyExc_ValueError, "too many words"); return 0; }
    for (int i = 0; i < *count; i++) free(words[i]);
    *count = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t L;
        const char *s = PyUnicode_AsUTF8AndSize(PySequence_Fast_GET_ITEM(fast, i), &L);
        if (!s) { Py_DECREF(fast); return 0; }
        words[i] = malloc(L + 1);
        memcpy(words[i], s, L + 1);
        lens[i] = L;
        *count = (int)i + 1;
    }
    Py_DECREF(fast);
    return 1;
}

static PyObject *configure(PyObject *self, PyObject *args)
{
    PyObject *st, *vd;
    if (!PyArg_ParseTuple(args, "OOL", &st, &vd, &max_line_bytes)) return NULL;
    if (!set_words(st, stages, stage_len, &n_stages) || !set_words(vd, verdicts, verdict_len, &n_verdicts)) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"scan_chunk", scan_chunk, METH_VARARGS,
     "scan_chunk(data, first_line, final) -> (status, why, n_lines, n_valid, torn_offset, columns, odd_lines)"},
    {"xxh64", py_xxh64, METH_VARARGS, "xxh64(data) -> int: xxh64 with seed 0"},
    {"ts_spellings", ts_spellings, METH_VARARGS,
     "ts_spellings(texts) -> (status, values): each '\\n'-separated ts text by the split's rule: status 0 odd, "
     "1 the writer's spelling (values: float64, as Python reads it), 2 16-17 digits left to Python's repr check"},
    {"configure", configure, METH_VARARGS, "configure(stages, verdicts, max_line_bytes)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cscan", "The fleet engine's native line pass.", -1, methods};

PyMODINIT_FUNC PyInit_cscan(void)
{
    init_classes();
#ifdef __SIZEOF_INT128__
    init_pow10_128();
#endif
#ifdef HAVE_STRTOD_L
    c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
#endif
    return PyModule_Create(&module);
}
