/* The fleet engine's native room table (docs/fleet.md, "The native room table").
 *
 * `RoomTable(prefill_stage, max_kept=4096)` folds the native line pass's rows
 * (`cscan.scan_chunk`'s columns, files and chunks in reading order) into one entry per key
 * (room, attempt), in C, with the counts the SQL classification (`classify.CLASSIFY`)
 * takes: prefill and decode records, digest-less ones, whether prefill sent one digest
 * hash with one rid and a digest `pack_digest` accepts, and whether every decode record
 * carries one digest hash. `mark_complex(keys)` adds the keys of records the reference
 * reads (odd lines, slow files). `judge()` then says of each key what the SQL says: clean
 * (decoded, every stage a match), clean prefill-only, or complex.
 * Each entry also keeps what the outputs take from SQL on the other path: the first
 * record of each decode (stage, step) (past `max_kept` of them the key is complex), the
 * first rids, the prefill tokens, instance, layout and cells, the first decode instance and
 * least decode ts, and the prefill records per `tokens` value (po_stats). Every record's
 * (entry, position) is kept too (12 bytes), so that `complex_positions()` names the lines
 * the reference joiner must read. `clean_rooms_json` writes the clean rooms' lines of
 * `diff --json` in blocks as `output.py` writes them from SQL, in order of their first
 * decode record. Entries are dense, in order of first appearance, behind an open-addressed
 * index of 32-bit entry numbers tagged with 32 bits of their hash; a room of up to 24 bytes
 * and a key's first three decode stages live in its entry, longer rooms and the rids' text in
 * one arena (no object per room), an entry holds references to its instances and layout
 * (shared strings). No Python loop runs per row.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

enum { K_P_DH = 1, K_P_DH_MULTI = 2, K_P_INVALID = 4, K_P_RID = 8, K_P_RID_MULTI = 16,
       K_D_DH = 32, K_D_DH_MULTI = 64, K_COMPLEX = 128, K_P_NULL = 256, K_D_NULL = 512, K_CAPPED = 1024,
       /* the selection (`select`): a decode record seen (here or by the reference), one in the
          window, any record in the window, any record of a matching instance */
       K_SEEN_D = 2048, K_D_WIN = 4096, K_ANY_WIN = 8192, K_INST = 16384 };

#define NULL_INT ((long long)INT64_MIN)  /* the pass's null for integers */
#define LINE_BITS 40                      /* positions.LINE_BITS */

typedef struct {          /* the first record of one decode (stage, step), and how many it has */
    long long step, ord;
    double ts;
    int32_t n;
    int8_t stage, live;
} Kept;

typedef struct {          /* prefill records of one `tokens` value (classify's po_groups / po_stats) */
    long long tokens;
    uint64_t dh;          /* the group's first record's digest hash */
    int32_t n, same;      /* its records; those whose digest (or its absence) is the first's */
    uint8_t has;          /* the first record has a digest */
} Group;

#define ROOM_INLINE 24  /* a room this long or shorter is kept in its entry (a 63-bit integer's digits fit) */
#define KEPT_INLINE 3   /* kept stages held in the entry before they move to the heap (recv, a step, finish) */

/* One key. A lookup reads the first 48 bytes only (hash, attempt, room), and a decode record
 * updates what follows: they sit together, so that a row touches one or two cache lines of
 * its entry and, for most rooms, no other memory (room text and first stages inline). */
typedef struct {
    Py_hash_t hash;
    long long attempt;
    int32_t room_len;     /* the key's room, in `room.in` up to ROOM_INLINE bytes, else in the arena at `room.at` */
    uint16_t flags;
    union { char in[ROOM_INLINE]; long long at; } room;
    int32_t p, d;
    long long first_d;        /* the first decode record's position */
    uint64_t p_dh, d_dh;
    double d_ts;              /* the least decode `ts` (NaN: none) */
    int32_t n_kept, cap_kept, n_groups;
    union { Kept in[KEPT_INLINE]; Kept *heap; } kept;  /* `in` while cap_kept <= KEPT_INLINE */
    /* texts kept in the table's arena, as (offset, UTF-8 length); length -1: none (null) */
    long long p_rid_at, p_rid_nn_at, d_rid_at;
    int32_t p_rid_len;    /* the first prefill record's rid (-1: null) */
    int32_t p_rid_nn_len; /* the first prefill rid that is not null (-1: none) */
    int32_t d_rid_len;    /* the first decode record's rid that is not null (-1: none) */
    PyObject *p_inst, *p_layout, *d_inst;  /* the first prefill record's instance and layout, the first decode one's */
    long long ptok;           /* the first prefill record's tokens */
    long long first_p;        /* the first prefill record's position */
    long long p_cells;        /* the first prefill record's digest cells */
    Group g0;                 /* the first tokens group; more in `groups` */
    Group *groups;
} KeyState;

static inline Kept *kept_of(KeyState *k) { return k->cap_kept > KEPT_INLINE ? k->kept.heap : k->kept.in; }

typedef struct {
    PyObject_HEAD
    uint64_t *index;      /* open addressing: entry number + 1 (low 32 bits; 0: an empty slot) and the
                             hash's high 32 bits, so that a probe past another key reads no entry */
    KeyState *keys;       /* the entries, in order of first appearance */
    Py_ssize_t cap, n, cap_keys, kept_bytes;
    uint32_t *rec_key;    /* every record's entry number, in the order added (reading order) */
    long long *rec_ord;   /* and its position */
    Py_ssize_t n_rec, cap_rec;
    KeyState **sorted;    /* the clean decoded keys by first decode position (sort_clean) */
    Py_ssize_t n_sorted;
    int8_t *judged;       /* each entry's judgment, kept until the next add (one byte a key to
                             read where a pass over the entries would read two cache lines each) */
    int selecting;        /* `select` was called: keys outside it are left out of everything */
    double since, until;  /* the window [since, until) (NaN: open) */
    PyObject *instance_ok;   /* instance -> bool (None: any instance) */
    PyObject *instance_seen; /* {instance: bool}, the answers so far */
    Py_ssize_t json_size; /* clean_rooms_json's last block's size */
    char *text;           /* the rooms' and rids' UTF-8 text, one after another (no object per string) */
    Py_ssize_t text_n, text_cap;
    int prefill_stage, max_kept;
} RoomTable;

static inline const char *room_of(const RoomTable *t, const KeyState *k)
{
    return k->room_len <= ROOM_INLINE ? k->room.in : t->text + k->room.at;
}

#define SLOT(h, e) (((uint64_t)(h) & 0xFFFFFFFF00000000ULL) | (uint64_t)(e))

static Py_hash_t key_hash(Py_hash_t room_hash, long long attempt)
{
    uint64_t h = (uint64_t)room_hash ^ ((uint64_t)attempt * 0x9E3779B185EBCA87ULL);
    h ^= h >> 29;
    Py_hash_t out = (Py_hash_t)h;
    return out == -1 ? -2 : out;
}

/* After a big array moved: give the pages of the old one back (glibc keeps freed heap
 * pages resident; the table's arrays grow by copying when they live in the heap). */
static void release_freed(void)
{
#ifdef __GLIBC__
    malloc_trim(0);
#endif
}

/* A str's UTF-8 bytes (lone surrogates passed through, as the reference may hold them);
 * *tmp holds them when they had to be encoded (the caller releases it). */
static const char *utf8_of(PyObject *s, Py_ssize_t *n, PyObject **tmp)
{
    *tmp = NULL;
    if (PyUnicode_IS_ASCII(s)) { *n = PyUnicode_GET_LENGTH(s); return (const char *)PyUnicode_DATA(s); }
    *tmp = PyUnicode_AsEncodedString(s, "utf-8", "surrogatepass");
    if (!*tmp) return NULL;
    *n = PyBytes_GET_SIZE(*tmp);
    return PyBytes_AS_STRING(*tmp);
}

/* `s` (a str, or None: length -1) copied into the arena: the table keeps no object per room
 * or rid, whose scattered survivors among the freed strings of each chunk would cost the
 * process nearly twice their size. */
static int keep_text(RoomTable *t, PyObject *s, long long *at, int32_t *len)
{
    *at = 0;
    *len = -1;
    if (s == Py_None) return 1;
    if (!PyUnicode_Check(s)) { PyErr_SetString(PyExc_TypeError, "a room or rid must be a str or None"); return 0; }
    PyObject *tmp;
    Py_ssize_t n;
    const char *u = utf8_of(s, &n, &tmp);
    if (!u) return 0;
    if (n > INT32_MAX) { Py_XDECREF(tmp); PyErr_SetString(PyExc_OverflowError, "a room or rid over 2 GB"); return 0; }
    if (t->text_n + n > t->text_cap) {
        Py_ssize_t cap = t->text_cap ? t->text_cap : 1 << 16;
        while (cap < t->text_n + n) cap += cap / 2;
        char *nt = realloc(t->text, cap);
        if (!nt) { Py_XDECREF(tmp); PyErr_NoMemory(); return 0; }
        if (nt != t->text && t->text_cap > (1 << 20)) release_freed();
        t->text = nt;
        t->text_cap = cap;
    }
    memcpy(t->text + t->text_n, u, n);
    *at = t->text_n;
    *len = (int32_t)n;
    t->text_n += n;
    Py_XDECREF(tmp);
    return 1;
}

/* 1 when the kept text (at, len) is `s` (a str or None), 0 when not, -1 on error. */
static int text_is(RoomTable *t, long long at, int32_t len, PyObject *s)
{
    if (s == Py_None || len < 0) return s == Py_None && len < 0;
    PyObject *tmp;
    Py_ssize_t n;
    const char *u = utf8_of(s, &n, &tmp);
    if (!u) return -1;
    int eq = n == len && memcmp(t->text + at, u, n) == 0;
    Py_XDECREF(tmp);
    return eq;
}

/* The kept text as a str (None for length -1). */
static PyObject *text_str(RoomTable *t, long long at, int32_t len)
{
    if (len < 0) Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(t->text + at, len, "surrogatepass");
}

static PyObject *room_str(const RoomTable *t, const KeyState *k)
{
    return PyUnicode_DecodeUTF8(room_of(t, k), k->room_len, "surrogatepass");
}

static int table_grow(RoomTable *t)
{
    Py_ssize_t cap = t->cap ? t->cap * 2 : 1024;
    uint64_t *index = calloc(cap, sizeof(uint64_t));
    if (!index) { PyErr_NoMemory(); return 0; }
    for (Py_ssize_t e = 0; e < t->n; e++) {
        Py_hash_t h = t->keys[e].hash;
        Py_ssize_t j = (Py_ssize_t)((uint64_t)h & (uint64_t)(cap - 1));
        while (index[j]) j = (j + 1) & (cap - 1);
        index[j] = SLOT(h, e + 1);
    }
    free(t->index);
    if (t->cap > (1 << 18)) release_freed();
    t->index = index;
    t->cap = cap;
    return 1;
}

/* The entry of (room, attempt), made when new (a strong reference to `room`); *id gets its number. */
static KeyState *table_entry(RoomTable *t, PyObject *room, long long attempt, uint32_t *id)
{
    if (!PyUnicode_Check(room)) { PyErr_SetString(PyExc_TypeError, "a room must be a str"); return NULL; }
    /* up to three quarters full: a probe past another key reads its slot's tag, not its entry */
    if ((t->n + 1) * 4 > t->cap * 3 && !table_grow(t)) return NULL;
    Py_hash_t rh = PyObject_Hash(room);
    if (rh == -1) return NULL;
    Py_hash_t h = key_hash(rh, attempt);
    Py_ssize_t mask = t->cap - 1, i = (Py_ssize_t)((uint64_t)h & (uint64_t)mask);
    PyObject *tmp;
    Py_ssize_t n;
    const char *u = utf8_of(room, &n, &tmp);
    if (!u) return NULL;
    for (;;) {
        uint64_t slot = t->index[i];
        if (!slot) break;
        if (slot == SLOT(h, slot & 0xFFFFFFFFULL)) {  /* the same high hash bits: look at the entry */
            uint32_t e = (uint32_t)slot;
            KeyState *k = &t->keys[e - 1];
            if (k->hash == h && k->attempt == attempt && k->room_len == n && memcmp(room_of(t, k), u, n) == 0) {
                Py_XDECREF(tmp);
                *id = e - 1;
                return k;
            }
        }
        i = (i + 1) & mask;
    }
    if (t->n >= (Py_ssize_t)UINT32_MAX - 1) {
        Py_XDECREF(tmp);
        PyErr_SetString(PyExc_OverflowError, "too many keys");
        return NULL;
    }
    if (n > INT32_MAX) { Py_XDECREF(tmp); PyErr_SetString(PyExc_OverflowError, "a room over 2 GB"); return NULL; }
    if (t->n == t->cap_keys) {
        Py_ssize_t cap = t->cap_keys ? t->cap_keys + t->cap_keys / 2 : 1024;
        KeyState *keys = realloc(t->keys, cap * sizeof(KeyState));
        if (!keys) { Py_XDECREF(tmp); PyErr_NoMemory(); return NULL; }
        if (keys != t->keys && t->cap_keys > 4096) release_freed();
        t->keys = keys;
        t->cap_keys = cap;
    }
    KeyState *k = &t->keys[t->n];
    memset(k, 0, sizeof *k);
    k->room_len = (int32_t)n;
    if (n <= ROOM_INLINE) memcpy(k->room.in, u, n);
    else {
        int32_t len;
        int ok = keep_text(t, room, &k->room.at, &len);
        if (!ok) { Py_XDECREF(tmp); return NULL; }
    }
    Py_XDECREF(tmp);
    k->p_rid_len = k->p_rid_nn_len = k->d_rid_len = -1;
    k->attempt = attempt;
    k->hash = h;
    k->d_ts = NAN;
    t->index[i] = SLOT(h, t->n + 1);
    *id = (uint32_t)t->n;
    t->n++;
    return k;
}

static int note_record(RoomTable *t, uint32_t id, long long ord)
{
    if (t->n_rec == t->cap_rec) {
        Py_ssize_t cap = t->cap_rec ? t->cap_rec + t->cap_rec / 2 : 1 << 16;
        uint32_t *a = realloc(t->rec_key, cap * sizeof(uint32_t));
        if (!a) { PyErr_NoMemory(); return 0; }
        t->rec_key = a;
        long long *b = realloc(t->rec_ord, cap * sizeof(long long));
        if (!b) { PyErr_NoMemory(); return 0; }
        t->rec_ord = b;
        if (t->cap_rec > (1 << 17)) release_freed();
        t->cap_rec = cap;
    }
    t->rec_key[t->n_rec] = id;
    t->rec_ord[t->n_rec++] = ord;
    return 1;
}


static int column(PyObject *cols, const char *name, Py_ssize_t width, Py_ssize_t n, Py_buffer *out)
{
    PyObject *o = PyDict_GetItemString(cols, name);
    if (!o) { PyErr_Format(PyExc_KeyError, "columns lack %s", name); return 0; }
    if (PyObject_GetBuffer(o, out, PyBUF_SIMPLE) < 0) return 0;
    if (out->len != n * width) {
        PyBuffer_Release(out);
        PyErr_Format(PyExc_ValueError, "column %s has %zd bytes, not %zd", name, out->len, n * width);
        return 0;
    }
    return 1;
}

/* What was derived from the keys' state (their order, judgments): stale once a row is added. */
static void forget_judgments(RoomTable *t)
{
    free(t->sorted);
    t->sorted = NULL;
    free(t->judged);
    t->judged = NULL;
}

/* The first record of the row's (stage, step) in the key's kept stages (the earliest position).
 * Past `max_kept` distinct (stage, step) the key goes to the reference join (complex). */
static int keep_stage(RoomTable *t, KeyState *k, int8_t stage, long long step, long long ord, int8_t live, double ts)
{
    if (k->flags & K_CAPPED) return 1;
    Kept *kept = kept_of(k);
    for (int32_t j = 0; j < k->n_kept; j++) {
        Kept *e = &kept[j];
        if (e->stage == stage && e->step == step) {
            if (ord < e->ord) { e->ord = ord; e->live = live; e->ts = ts; }
            e->n++;
            return 1;
        }
    }
    if (k->n_kept >= t->max_kept) {
        k->flags |= K_CAPPED | K_COMPLEX;
        if (k->cap_kept > KEPT_INLINE) {
            t->kept_bytes -= k->cap_kept * (Py_ssize_t)sizeof(Kept);
            free(k->kept.heap);
        }
        k->n_kept = k->cap_kept = 0;
        return 1;
    }
    if (k->n_kept == k->cap_kept) {
        if (!k->cap_kept) k->cap_kept = KEPT_INLINE;  /* the entry's own room first */
        else {
            int32_t cap = k->cap_kept * 2;
            Kept *nk = malloc(cap * sizeof(Kept));
            if (!nk) { PyErr_NoMemory(); return 0; }
            memcpy(nk, kept, k->n_kept * sizeof(Kept));
            if (k->cap_kept > KEPT_INLINE) {
                free(kept);
                t->kept_bytes -= k->cap_kept * (Py_ssize_t)sizeof(Kept);
            }
            t->kept_bytes += cap * (Py_ssize_t)sizeof(Kept);
            k->kept.heap = kept = nk;
            k->cap_kept = cap;
        }
    }
    kept[k->n_kept++] = (Kept){step, ord, ts, 1, stage, live};
    return 1;
}

/* A prefill record into its `tokens` group (classify's po_groups and po_stats). */
static int keep_group(RoomTable *t, KeyState *k, long long tokens, int has, uint64_t dh)
{
    Group *g = NULL;
    if (k->n_groups && k->g0.tokens == tokens) g = &k->g0;
    for (int32_t j = 0; !g && j + 1 < k->n_groups; j++)
        if (k->groups[j].tokens == tokens) g = &k->groups[j];
    if (g) {
        g->n++;
        g->same += g->has ? (has && g->dh == dh) : !has;
        return 1;
    }
    Group fresh = {tokens, has ? dh : 0, 1, 1, (uint8_t)has};
    if (!k->n_groups) { k->g0 = fresh; k->n_groups = 1; return 1; }
    Group *ng = realloc(k->groups, k->n_groups * sizeof(Group));
    if (!ng) { PyErr_NoMemory(); return 0; }
    t->kept_bytes += (Py_ssize_t)sizeof(Group);
    k->groups = ng;
    k->groups[k->n_groups - 1] = fresh;
    k->n_groups++;
    return 1;
}

static int in_window(const RoomTable *t, double ts)
{
    if (isnan(ts)) return isnan(t->since) && isnan(t->until);
    return (isnan(t->since) || ts >= t->since) && (isnan(t->until) || ts < t->until);
}

/* Whether an instance (a str or None) matches the selection's patterns; -1 on error. */
static int instance_matches(RoomTable *t, PyObject *inst)
{
    if (t->instance_ok == Py_None) return 1;
    if (inst == Py_None) return 0;
    PyObject *was = PyDict_GetItemWithError(t->instance_seen, inst);
    if (!was) {
        if (PyErr_Occurred()) return -1;
        PyObject *r = PyObject_CallOneArg(t->instance_ok, inst);
        if (!r) return -1;
        int ok = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (ok < 0 || PyDict_SetItem(t->instance_seen, inst, ok ? Py_True : Py_False) < 0) return -1;
        return ok;
    }
    return was == Py_True;
}

#define N_COLS 10
static const char *col_names[N_COLS] = {"attempt", "stage", "flags", "dh", "line", "step", "live", "tokens", "ts", "cells"};
static const Py_ssize_t col_width[N_COLS] = {8, 1, 1, 8, 8, 8, 1, 8, 8, 8};

static PyObject *text_list(PyObject *cols, const char *name, Py_ssize_t n)
{
    PyObject *o = PyDict_GetItemString(cols, name);
    if (!o || !PyList_Check(o) || PyList_GET_SIZE(o) != n) {
        PyErr_Format(PyExc_ValueError, "columns need the list %s, as long as room", name);
        return NULL;
    }
    return o;
}

#define PREFETCH_ROWS 16

static PyObject *table_add(RoomTable *t, PyObject *args)
{
    PyObject *cols;
    long long fid = 0;
    if (!PyArg_ParseTuple(args, "O|L", &cols, &fid)) return NULL;
    if (!PyDict_Check(cols)) { PyErr_SetString(PyExc_TypeError, "columns must be a dict"); return NULL; }
    PyObject *rooms = PyDict_GetItemString(cols, "room"), *rids = PyDict_GetItemString(cols, "rid");
    if (!rooms || !rids || !PyList_Check(rooms) || !PyList_Check(rids) || PyList_GET_SIZE(rids) != PyList_GET_SIZE(rooms)) {
        PyErr_SetString(PyExc_ValueError, "columns need the lists room and rid, of one length");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(rooms);
    PyObject *insts = text_list(cols, "instance", n), *layouts = insts ? text_list(cols, "layout", n) : NULL;
    if (!layouts) return NULL;
    forget_judgments(t);
    Py_buffer b[N_COLS];
    int got = 0, ok = 0;
    for (; got < N_COLS; got++)
        if (!column(cols, col_names[got], col_width[got], n, &b[got])) goto done;
    const long long *attempt = b[0].buf, *line = b[4].buf, *step = b[5].buf, *tokens = b[7].buf, *cells = b[9].buf;
    const int8_t *stage = b[1].buf, *live = b[6].buf;
    const uint8_t *flags = b[2].buf;
    const uint64_t *dh = b[3].buf;
    const double *ts = b[8].buf;
    KeyState *k = NULL;
    uint32_t id = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* the index slot of a room some rows ahead, asked for now: a key's first row misses
           the cache there (the index is tens of MB, its slots random) */
        if (i + PREFETCH_ROWS < n) {
            PyObject *ahead = PyList_GET_ITEM(rooms, i + PREFETCH_ROWS);
            if (PyUnicode_CheckExact(ahead) && ahead != PyList_GET_ITEM(rooms, i + PREFETCH_ROWS - 1) && t->cap) {
                Py_hash_t h = key_hash(PyObject_Hash(ahead), attempt[i + PREFETCH_ROWS]);
                __builtin_prefetch(&t->index[(uint64_t)h & (uint64_t)(t->cap - 1)]);
            }
        }
        /* a key's records mostly follow one another, and the pass hands equal rooms in a row
           as one str: the same object and attempt are the same entry, without a lookup */
        if (!k || PyList_GET_ITEM(rooms, i) != PyList_GET_ITEM(rooms, i - 1) || attempt[i] != attempt[i - 1])
            k = table_entry(t, PyList_GET_ITEM(rooms, i), attempt[i], &id);
        if (!k) goto done;
        int has = flags[i] & 1;
        long long ord = (fid << LINE_BITS) | line[i];
        if (!note_record(t, id, ord)) goto done;
        PyObject *rid = PyList_GET_ITEM(rids, i);
        if (t->selecting) {
            int win = in_window(t, ts[i]), ok = instance_matches(t, PyList_GET_ITEM(insts, i));
            if (ok < 0) goto done;
            if (win) k->flags |= K_ANY_WIN;
            if (ok) k->flags |= K_INST;
            if (stage[i] != t->prefill_stage) k->flags |= win ? K_SEEN_D | K_D_WIN : K_SEEN_D;
        }
        if (stage[i] == t->prefill_stage) {
            if (k->p == 0 || ord < k->first_p) k->first_p = ord;
            if (k->p++ == 0) {
                PyObject *inst = PyList_GET_ITEM(insts, i), *lay = PyList_GET_ITEM(layouts, i);
                k->ptok = tokens[i];
                k->p_cells = cells[i];
                Py_INCREF(inst);
                k->p_inst = inst;
                Py_INCREF(lay);
                k->p_layout = lay;
            }
            if (k->p >= (1 << 30)) k->flags |= K_COMPLEX;
            if (!has) k->flags |= K_P_NULL;
            else {
                if (!(flags[i] & 2)) k->flags |= K_P_INVALID;
                if (!(k->flags & K_P_DH)) { k->p_dh = dh[i]; k->flags |= K_P_DH; }
                else if (k->p_dh != dh[i]) k->flags |= K_P_DH_MULTI;
            }
            if (!(k->flags & K_P_RID)) {
                if (!keep_text(t, rid, &k->p_rid_at, &k->p_rid_len)) goto done;
                k->flags |= K_P_RID;
            }
            else if (!(k->flags & K_P_RID_MULTI)) {
                int same = text_is(t, k->p_rid_at, k->p_rid_len, rid);
                if (same < 0) goto done;
                if (!same) k->flags |= K_P_RID_MULTI;
            }
            if (rid != Py_None && k->p_rid_nn_len < 0) {
                if (k->p_rid_len >= 0) k->p_rid_nn_at = k->p_rid_at, k->p_rid_nn_len = k->p_rid_len;
                else if (!keep_text(t, rid, &k->p_rid_nn_at, &k->p_rid_nn_len)) goto done;
            }
            if (!keep_group(t, k, tokens[i], has, dh[i])) goto done;
        } else {
            if (k->d == 0 || ord < k->first_d) k->first_d = ord;
            if (k->d++ == 0) {
                PyObject *inst = PyList_GET_ITEM(insts, i);
                Py_INCREF(inst);
                k->d_inst = inst;
            }
            if (k->d >= (1 << 30)) k->flags |= K_COMPLEX;
            if (!isnan(ts[i]) && (isnan(k->d_ts) || ts[i] < k->d_ts)) k->d_ts = ts[i];
            if (!has) k->flags |= K_D_NULL;
            else if (!(k->flags & K_D_DH)) { k->d_dh = dh[i]; k->flags |= K_D_DH; }
            else if (k->d_dh != dh[i]) k->flags |= K_D_DH_MULTI;
            if (rid != Py_None && k->d_rid_len < 0 && !keep_text(t, rid, &k->d_rid_at, &k->d_rid_len)) goto done;
            if (!keep_stage(t, k, stage[i], step[i], ord, live[i], ts[i])) goto done;
        }
    }
    ok = 1;
done:
    for (int j = 0; j < got; j++) PyBuffer_Release(&b[j]);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* select(since, until, instance_ok): keep only the keys with a decode record whose ts is in
 * [since, until) (a key never decoded: any record's), and a record of an instance
 * `instance_ok` accepts (None: any); NaN: an open end. Before any row is added. */
static PyObject *table_select(RoomTable *t, PyObject *args)
{
    double since, until;
    PyObject *ok;
    if (!PyArg_ParseTuple(args, "ddO", &since, &until, &ok)) return NULL;
    if (t->n) { PyErr_SetString(PyExc_ValueError, "select before adding rows"); return NULL; }
    if (ok != Py_None && !PyCallable_Check(ok)) { PyErr_SetString(PyExc_TypeError, "instance_ok must be callable or None"); return NULL; }
    PyObject *seen = PyDict_New();
    if (!seen) return NULL;
    Py_INCREF(ok);
    Py_XSETREF(t->instance_ok, ok);
    Py_XSETREF(t->instance_seen, seen);
    t->since = since;
    t->until = until;
    t->selecting = 1;
    Py_RETURN_NONE;
}

static PyObject *table_mark_complex(RoomTable *t, PyObject *keys)
{
    PyObject *it = PyObject_GetIter(keys), *item;
    if (!it) return NULL;
    forget_judgments(t);
    while ((item = PyIter_Next(it))) {
        PyObject *room;
        long long attempt;
        int decode = 0, win = 0, ok = 0;
        uint32_t id;
        if (!PyArg_ParseTuple(item, "OL|ppp", &room, &attempt, &decode, &win, &ok)) {
            Py_DECREF(item);
            Py_DECREF(it);
            return NULL;
        }
        KeyState *k = table_entry(t, room, attempt, &id);
        Py_DECREF(item);
        if (!k) { Py_DECREF(it); return NULL; }
        k->flags |= K_COMPLEX;
        if (win) k->flags |= K_ANY_WIN;
        if (ok) k->flags |= K_INST;
        if (decode) k->flags |= win ? K_SEEN_D | K_D_WIN : K_SEEN_D;
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* Whether a key is in the selection (filters.filter_sql's rule; every key without one). */
static int selected(const RoomTable *t, const KeyState *k)
{
    if (!t->selecting) return 1;
    int win = k->flags & K_SEEN_D ? (k->flags & K_D_WIN) != 0 : (k->flags & K_ANY_WIN) != 0;
    return win && (k->flags & K_INST);
}

/* -1: not selected (left out of everything), 0: complex, 1: clean (decoded), 2: clean
 * prefill-only: classify.CLASSIFY's rule. */
static int judgment(const RoomTable *t, const KeyState *k)
{
    if (!selected(t, k)) return -1;
    if (k->flags & K_COMPLEX) return 0;
    if (k->d > 0 && k->p > 0 && !(k->flags & K_P_NULL) && (k->flags & K_P_DH) && !(k->flags & K_P_DH_MULTI)
        && !(k->flags & K_P_INVALID) && !(k->flags & K_P_RID_MULTI) && !(k->flags & K_D_NULL)
        && !(k->flags & K_D_DH_MULTI) && k->d_dh == k->p_dh)
        return 1;
    if (k->d == 0 && k->p > 0 && !(k->flags & K_P_INVALID)) return 2;
    return 0;
}

/* Every entry's judgment (t->judged), made when missing; NULL on error. */
static const int8_t *judgments(RoomTable *t)
{
    if (t->judged) return t->judged;
    t->judged = malloc(t->n ? t->n : 1);
    if (!t->judged) { PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < t->n; i++) t->judged[i] = (int8_t)judgment(t, &t->keys[i]);
    return t->judged;
}

static PyObject *table_judge(RoomTable *t, PyObject *unused)
{
    static const char *names[3] = {"complex", "clean", "prefill_only"};
    const int8_t *judged = judgments(t);
    if (!judged) return NULL;
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < t->n; i++) {
        const KeyState *k = &t->keys[i];
        int j = judged[i];
        if (j < 0) continue;
        PyObject *key = Py_BuildValue("(NL)", room_str(t, k), k->attempt);
        PyObject *v = key ? PyUnicode_FromString(names[j]) : NULL;
        if (!v || PyDict_SetItem(out, key, v) < 0) { Py_XDECREF(key); Py_XDECREF(v); Py_DECREF(out); return NULL; }
        Py_DECREF(key);
        Py_DECREF(v);
    }
    return out;
}

static PyObject *table_counts(RoomTable *t, PyObject *unused)
{
    long long c[3] = {0, 0, 0};
    const int8_t *judged = judgments(t);
    if (!judged) return NULL;
    for (Py_ssize_t i = 0; i < t->n; i++)
        if (judged[i] >= 0) c[judged[i]]++;
    return Py_BuildValue("{sLsLsL}", "complex", c[0], "clean", c[1], "prefill_only", c[2]);
}

/* [(room, attempt)] of the complex keys (in the selection). */
static PyObject *table_complex_keys(RoomTable *t, PyObject *unused)
{
    const int8_t *judged = judgments(t);
    if (!judged) return NULL;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out && i < t->n; i++) {
        const KeyState *k = &t->keys[i];
        if (judged[i] != 0) continue;
        PyObject *key = Py_BuildValue("(NL)", room_str(t, k), k->attempt);
        if (!key || PyList_Append(out, key) < 0) { Py_XDECREF(key); Py_CLEAR(out); break; }
        Py_DECREF(key);
    }
    return out;
}

/* The positions of every record of a complex key, in reading order (the reference join reads them). */
static PyObject *table_complex_positions(RoomTable *t, PyObject *unused)
{
    const int8_t *judged = judgments(t);
    if (!judged) return NULL;
    Py_ssize_t m = 0;
    for (Py_ssize_t r = 0; r < t->n_rec; r++) m += judged[t->rec_key[r]] == 0;
    PyObject *out = PyBytes_FromStringAndSize(NULL, m * (Py_ssize_t)sizeof(long long));
    if (out) {
        long long *o = (long long *)PyBytes_AS_STRING(out);
        for (Py_ssize_t r = 0; r < t->n_rec; r++)
            if (judged[t->rec_key[r]] == 0) *o++ = t->rec_ord[r];
    }
    return out;
}

/* ---- the clean rooms' JSON, as output._clean_rooms writes it from SQL ---- */

/* Text made straight into a bytes object (handed out as it is: no copy of each block). */
typedef struct {
    PyObject *obj;  /* the bytes, `cap` long, `n` of them written */
    Py_ssize_t n, cap;
    int high;  /* a text put here has a byte json_safe may escape (DEL or past ASCII) */
} Buf;

static int put(Buf *b, const char *s, Py_ssize_t n)
{
    if (b->n + n > b->cap) {
        Py_ssize_t cap = b->cap ? b->cap : 1 << 16;
        while (cap < b->n + n) cap *= 2;
        if (!b->obj) b->obj = PyBytes_FromStringAndSize(NULL, cap);
        else if (_PyBytes_Resize(&b->obj, cap) < 0) b->obj = NULL;  /* (it freed the old one) */
        if (!b->obj) return 0;
        b->cap = cap;
    }
    memcpy(PyBytes_AS_STRING(b->obj) + b->n, s, n);
    b->n += n;
    return 1;
}
#define PUTS(b, s) put((b), (s), (Py_ssize_t)strlen(s))

/* A room's or rid's text: noted when json_safe may have to escape a byte of it. */
static int put_text(Buf *b, const char *s, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) b->high |= (uint8_t)s[i] >= 0x7F;
    return put(b, s, n);
}

/* Whether a str of the tuple has a byte json_safe may escape. */
static int tuple_high(PyObject *tuple)
{
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(tuple); j++) {
        PyObject *s = PyTuple_GET_ITEM(tuple, j);
        if (!PyUnicode_IS_ASCII(s) || PyUnicode_FindChar(s, 0x7F, 0, PyUnicode_GET_LENGTH(s), 1) != -1) return 1;
    }
    return 0;
}

static int put_int(Buf *b, long long v)
{
    char tmp[24], *e = tmp + sizeof tmp, *p = e;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do { *--p = (char)('0' + u % 10); u /= 10; } while (u);
    if (v < 0) *--p = '-';
    return put(b, p, e - p);
}

static int put_str(Buf *b, PyObject *s)  /* a str's UTF-8 bytes (callers quote them) */
{
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    return u && put(b, u, n);
}

static int put_text_or_null(Buf *b, RoomTable *t, long long at, int32_t len)  /* quoted, or null */
{
    if (len < 0) return PUTS(b, "null");
    return PUTS(b, "\"") && put_text(b, t->text + at, len) && PUTS(b, "\"");
}

static int stage_rank[256];

static int cmp_kept(const void *x, const void *y)
{
    const Kept *a = x, *b = y;
    int ra = stage_rank[(uint8_t)a->stage], rb = stage_rank[(uint8_t)b->stage];
    if (ra != rb) return ra < rb ? -1 : 1;
    long long sa = a->step == NULL_INT ? 0 : a->step, sb = b->step == NULL_INT ? 0 : b->step;
    if (sa != sb) return sa < sb ? -1 : 1;
    return a->ord < b->ord ? -1 : a->ord > b->ord;
}

typedef struct { long long first_d; KeyState *k; } ByFirst;

static int cmp_first_d(const void *x, const void *y)
{
    const ByFirst *a = x, *b = y;
    return a->first_d < b->first_d ? -1 : a->first_d > b->first_d;
}

static int room_json(Buf *b, RoomTable *t, KeyState *k, PyObject *stages, PyObject *verdicts, PyObject *wesc, int finish)
{
    Kept *kept = kept_of(k);
    qsort(kept, k->n_kept, sizeof(Kept), cmp_kept);
    int closed = 0;
    if (!PUTS(b, "{\"room\":\"") || !put_text(b, room_of(t, k), k->room_len) || !PUTS(b, "\",\"attempt\":")
        || !put_int(b, k->attempt)
        || !PUTS(b, ",\"rid\":{\"prefill\":") || !put_text_or_null(b, t, k->p_rid_at, k->p_rid_len)
        || !PUTS(b, ",\"decode\":") || !put_text_or_null(b, t, k->d_rid_at, k->d_rid_len)
        || !PUTS(b, "},\"verdict\":\"match\",\"first_divergence\":null,\"last_match_before\":null,\"stages\":["))
        return 0;
    for (int32_t j = 0; j < k->n_kept; j++) {
        const Kept *e = &kept[j];
        long long fid = e->ord >> LINE_BITS;
        if (e->stage < 0 || e->stage >= PyTuple_GET_SIZE(stages) || fid >= PyTuple_GET_SIZE(wesc)
            || e->live >= PyTuple_GET_SIZE(verdicts)) {
            PyErr_SetString(PyExc_ValueError, "a kept stage outside the stages, verdicts or files given");
            return 0;
        }
        closed |= e->stage == finish;
        if ((j && !PUTS(b, ",")) || !PUTS(b, "{\"stage\":\"") || !put_str(b, PyTuple_GET_ITEM(stages, e->stage))
            || !PUTS(b, "\",\"step\":") || !(e->step == NULL_INT ? PUTS(b, "null") : put_int(b, e->step))
            || !PUTS(b, ",\"verdict\":\"match\""))
            return 0;
        if (k->ptok != NULL_INT && (!PUTS(b, ",\"tokens\":") || !put_int(b, k->ptok))) return 0;
        if (e->live >= 0) {
            PyObject *v = PyTuple_GET_ITEM(verdicts, e->live);
            if (PyUnicode_CompareWithASCIIString(v, "match") != 0
                && (!PUTS(b, ",\"live_verdict\":\"") || !put_str(b, v) || !PUTS(b, "\"")))
                return 0;
        }
        if (!PUTS(b, ",\"where\":\"") || !put_str(b, PyTuple_GET_ITEM(wesc, fid)) || !PUTS(b, ":")
            || !put_int(b, e->ord & ((1LL << LINE_BITS) - 1)) || !PUTS(b, "\"}"))
            return 0;
    }
    return PUTS(b, closed ? "],\"closed\":true}" : "],\"closed\":false}");
}

/* The clean decoded keys in order of their first decode record, kept until the next add. */
static int sort_clean(RoomTable *t)
{
    if (t->sorted) return 1;
    const int8_t *judged = judgments(t);
    if (!judged) return 0;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < t->n; i++) n += judged[i] == 1;
    /* sorted as (position, entry) pairs: a comparison then reads no entry */
    ByFirst *pairs = malloc((n ? n : 1) * sizeof(ByFirst));
    t->sorted = malloc((n ? n : 1) * sizeof(KeyState *));
    if (!pairs || !t->sorted) { free(pairs); free(t->sorted); t->sorted = NULL; PyErr_NoMemory(); return 0; }
    n = 0;
    for (Py_ssize_t i = 0; i < t->n; i++)
        if (judged[i] == 1) pairs[n++] = (ByFirst){t->keys[i].first_d, &t->keys[i]};
    qsort(pairs, n, sizeof(ByFirst), cmp_first_d);
    for (Py_ssize_t i = 0; i < n; i++) t->sorted[i] = pairs[i].k;
    free(pairs);
    t->n_sorted = n;
    return 1;
}

static PyObject *table_clean_rooms_json(RoomTable *t, PyObject *args)
{
    PyObject *stages, *verdicts, *wesc;
    Py_ssize_t start = 0, stop = PY_SSIZE_T_MAX;
    const char *sep = "";
    Py_ssize_t sep_len = 0;
    if (!PyArg_ParseTuple(args, "O!O!O!|nny#", &PyTuple_Type, &stages, &PyTuple_Type, &verdicts, &PyTuple_Type, &wesc,
                          &start, &stop, &sep, &sep_len))
        return NULL;
    int finish = -1;
    for (int j = 0; j < 256; j++) stage_rank[j] = 2;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(stages) && j < 128; j++) {
        PyObject *s = PyTuple_GET_ITEM(stages, j);
        if (!PyUnicode_Check(s)) { PyErr_SetString(PyExc_TypeError, "stages must be str"); return NULL; }
        if (PyUnicode_CompareWithASCIIString(s, "decode_recv") == 0) stage_rank[j] = 0;
        if (PyUnicode_CompareWithASCIIString(s, "decode_step") == 0) stage_rank[j] = 1;
        if (PyUnicode_CompareWithASCIIString(s, "decode_finish") == 0) finish = (int)j;
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(verdicts); j++)
        if (!PyUnicode_Check(PyTuple_GET_ITEM(verdicts, j))) { PyErr_SetString(PyExc_TypeError, "verdicts must be str"); return NULL; }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(wesc); j++)
        if (!PyUnicode_Check(PyTuple_GET_ITEM(wesc, j))) { PyErr_SetString(PyExc_TypeError, "file names must be str"); return NULL; }
    if (!sort_clean(t)) return NULL;
    if (start < 0) start = 0;
    if (stop > t->n_sorted) stop = t->n_sorted;
    Py_ssize_t n = stop > start ? stop - start : 0;
    long long *ords = malloc((n ? n : 1) * sizeof(long long)), *ends = malloc((n ? n : 1) * sizeof(long long));
    /* sized as the last block and a little more: grown by doubling, a block's text would be
       copied on the way */
    Buf b = {NULL, 0, 0, tuple_high(stages) || tuple_high(verdicts) || tuple_high(wesc)};
    PyObject *result = NULL;
    if (!ords || !ends) { PyErr_NoMemory(); goto out; }
    if (t->json_size && !(b.obj = PyBytes_FromStringAndSize(NULL, t->json_size + t->json_size / 8))) goto out;
    b.cap = b.obj ? PyBytes_GET_SIZE(b.obj) : 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        KeyState *k = t->sorted[start + i];
        if (!room_json(&b, t, k, stages, verdicts, wesc, finish)) goto out;
        ords[i] = k->first_d;
        ends[i] = b.n;
        if (sep_len && !put(&b, sep, sep_len)) goto out;
    }
    if (!b.obj && !(b.obj = PyBytes_FromStringAndSize(NULL, 0))) goto out;
    if (b.n < b.cap && _PyBytes_Resize(&b.obj, b.n) < 0) goto out;  /* shrunk in place */
    t->json_size = b.n;
    result = Py_BuildValue("(y#y#NO)", (const char *)ords, n * (Py_ssize_t)sizeof(long long),
                           (const char *)ends, n * (Py_ssize_t)sizeof(long long), b.obj, b.high ? Py_False : Py_True);
    b.obj = NULL;  /* the tuple has it (or it was released with the failed tuple) */
out:
    free(ords);
    free(ends);
    Py_XDECREF(b.obj);
    return result;
}

/* The counts summary.merge takes from SQL for the clean keys: rooms, open rooms (no
 * decode_finish), kept stages whose live verdict is mismatch or not_comparable, duplicate
 * records (decode records past the first of their (stage, step), prefill records past the
 * first; of prefill-only keys, po_stats' records like their group's first), conflicts
 * (po_stats' others), prefill-only keys, and the records of every clean key with the first
 * one's position; `stages`: per decode stage, (the first clean room having it, the least
 * position of its kept records there, how many kept records). */
static PyObject *table_clean_counts(RoomTable *t, PyObject *args)
{
    int finish, live_mismatch, live_nc;
    if (!PyArg_ParseTuple(args, "iii", &finish, &live_mismatch, &live_nc)) return NULL;
    long long rooms = 0, open = 0, live = 0, dups = 0, records = 0, first = -1, po = 0, conflicts = 0, first_d = -1;
    long long st_room[128], st_ord[128], st_n[128];
    for (int s = 0; s < 128; s++) st_room[s] = -1, st_ord[s] = -1, st_n[s] = 0;
    const int8_t *judged = judgments(t);
    if (!judged) return NULL;
    for (Py_ssize_t i = 0; i < t->n; i++) {
        const KeyState *k = &t->keys[i];
        int j = judged[i];
        if (j <= 0) continue;
        records += k->p + k->d;
        long long f = k->d && k->first_d < k->first_p ? k->first_d : k->first_p;
        if (first < 0 || f < first) first = f;
        if (j == 2) {
            po++;
            for (int32_t g = 0; g < k->n_groups; g++) {
                const Group *e = g ? &k->groups[g - 1] : &k->g0;
                dups += e->same - 1;
                conflicts += e->n - e->same;
            }
            continue;
        }
        rooms++;
        dups += k->p - 1;
        if (first_d < 0 || k->first_d < first_d) first_d = k->first_d;
        int closed = 0;
        const Kept *kept = kept_of((KeyState *)k);
        for (int32_t s = 0; s < k->n_kept; s++) {
            const Kept *e = &kept[s];
            closed |= e->stage == finish;
            live += e->live == live_mismatch || e->live == live_nc;
            dups += e->n - 1;
            if (e->stage < 0) continue;
            int g = e->stage;
            st_n[g]++;
            if (st_room[g] < 0 || k->first_d < st_room[g]) { st_room[g] = k->first_d; st_ord[g] = e->ord; }
            else if (k->first_d == st_room[g] && e->ord < st_ord[g]) st_ord[g] = e->ord;
        }
        open += !closed;
    }
    PyObject *stages = PyDict_New();
    if (!stages) return NULL;
    for (int s = 0; s < 128; s++) {
        if (!st_n[s]) continue;
        PyObject *key = PyLong_FromLong(s), *v = Py_BuildValue("(LLL)", st_room[s], st_ord[s], st_n[s]);
        if (!key || !v || PyDict_SetItem(stages, key, v) < 0) { Py_XDECREF(key); Py_XDECREF(v); Py_DECREF(stages); return NULL; }
        Py_DECREF(key);
        Py_DECREF(v);
    }
    return Py_BuildValue("{sLsLsLsLsLsLsLsLsLsN}", "rooms", rooms, "open", open, "live", live, "duplicates", dups,
                         "records", records, "first_record", first, "prefill_only", po, "conflicts", conflicts,
                         "first_decode", first_d, "stages", stages);
}

/* Coverage of the clean keys (instances.clean_coverage's rows): {(outcome, instance, layout,
 * cells): keys}, the instance of a decoded key's first decode record, of a prefill-only key's
 * first prefill record; layout and cells of its first prefill record. */
static PyObject *table_clean_coverage(RoomTable *t, PyObject *unused)
{
    PyObject *out = PyDict_New(), *empty = PyUnicode_FromString(""), *verified = PyUnicode_FromString("verified"),
             *unverified = PyUnicode_FromString("unverified");
    if (!out || !empty || !verified || !unverified) goto fail;
    const int8_t *judged = judgments(t);
    if (!judged) goto fail;
    for (Py_ssize_t i = 0; i < t->n; i++) {
        const KeyState *k = &t->keys[i];
        int j = judged[i];
        if (j <= 0) continue;
        PyObject *inst = j == 1 ? k->d_inst : k->p_inst;
        if (!inst || inst == Py_None) inst = empty;
        PyObject *cells = k->p_cells == NULL_INT ? (Py_INCREF(Py_None), Py_None) : PyLong_FromLongLong(k->p_cells);
        if (!cells) goto fail;
        PyObject *key = PyTuple_Pack(4, j == 1 ? verified : unverified, inst, k->p_layout ? k->p_layout : Py_None, cells);
        Py_DECREF(cells);
        if (!key) goto fail;
        PyObject *was = PyDict_GetItemWithError(out, key);
        if (!was && PyErr_Occurred()) { Py_DECREF(key); goto fail; }
        PyObject *now = PyLong_FromLongLong((was ? PyLong_AsLongLong(was) : 0) + 1);
        if (!now || PyDict_SetItem(out, key, now) < 0) { Py_XDECREF(now); Py_DECREF(key); goto fail; }
        Py_DECREF(now);
        Py_DECREF(key);
    }
    Py_DECREF(empty);
    Py_DECREF(verified);
    Py_DECREF(unverified);
    return out;
fail:
    Py_XDECREF(out);
    Py_XDECREF(empty);
    Py_XDECREF(verified);
    Py_XDECREF(unverified);
    return NULL;
}

/* [(first prefill position, room, attempt, first rid that is not null or None)] of the clean
 * prefill-only keys, in that order (output's prefill-only rooms). */
static int cmp_po(const void *x, const void *y)
{
    const KeyState *a = *(KeyState *const *)x, *b = *(KeyState *const *)y;
    return a->first_p < b->first_p ? -1 : a->first_p > b->first_p;
}

static PyObject *table_prefill_only(RoomTable *t, PyObject *unused)
{
    const int8_t *judged = judgments(t);
    if (!judged) return NULL;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < t->n; i++) n += judged[i] == 2;
    KeyState **keys = malloc((n ? n : 1) * sizeof(KeyState *));
    if (!keys) return PyErr_NoMemory();
    n = 0;
    for (Py_ssize_t i = 0; i < t->n; i++)
        if (judged[i] == 2) keys[n++] = &t->keys[i];
    qsort(keys, n, sizeof(KeyState *), cmp_po);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        KeyState *k = keys[i];
        PyObject *row = Py_BuildValue("(LNLN)", k->first_p, room_str(t, k), k->attempt,
                                      text_str(t, k->p_rid_nn_at, k->p_rid_nn_len));
        if (!row) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, row);
    }
    free(keys);
    return out;
}

/* [(least decode ts, first decode record's instance or '')] of the clean decoded keys with a
 * ts (the report's timeline). */
static PyObject *table_timeline(RoomTable *t, PyObject *unused)
{
    const int8_t *judged = judgments(t);
    if (!judged) return NULL;
    PyObject *out = PyList_New(0), *empty = PyUnicode_FromString("");
    if (!out || !empty) { Py_XDECREF(out); Py_XDECREF(empty); return NULL; }
    for (Py_ssize_t i = 0; i < t->n; i++) {
        const KeyState *k = &t->keys[i];
        if (judged[i] != 1 || isnan(k->d_ts)) continue;
        PyObject *row = Py_BuildValue("(dO)", k->d_ts, k->d_inst && k->d_inst != Py_None ? k->d_inst : empty);
        if (!row || PyList_Append(out, row) < 0) { Py_XDECREF(row); Py_DECREF(out); Py_DECREF(empty); return NULL; }
        Py_DECREF(row);
    }
    Py_DECREF(empty);
    return out;
}

/* The clean decoded keys whose prefill or decode rid is in `rids` (a set):
 * [(first decode position, room, attempt, prefill rid, decode rid, prefill tokens or None,
 *   [(stage, step or None, live or -1, ts, position)] in position order)]. */
static int cmp_kept_ord(const void *x, const void *y)
{
    const Kept *a = x, *b = y;
    return a->ord < b->ord ? -1 : a->ord > b->ord;
}

static PyObject *table_rooms_for_rids(RoomTable *t, PyObject *rids)
{
    if (!PyAnySet_Check(rids)) { PyErr_SetString(PyExc_TypeError, "rids must be a set"); return NULL; }
    const int8_t *judged = judgments(t);
    if (!judged) return NULL;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < t->n; i++) {
        KeyState *k = &t->keys[i];
        if (judged[i] != 1) continue;
        int hit = 0;
        PyObject *prid = text_str(t, k->p_rid_at, k->p_rid_len), *drid = prid ? text_str(t, k->d_rid_at, k->d_rid_len) : NULL;
        if (!drid) { Py_XDECREF(prid); Py_DECREF(out); return NULL; }
        PyObject *cand[2] = {prid, drid};
        for (int c = 0; c < 2 && !hit; c++) {
            if (cand[c] == Py_None) continue;
            hit = PySet_Contains(rids, cand[c]);
            if (hit < 0) { Py_DECREF(prid); Py_DECREF(drid); Py_DECREF(out); return NULL; }
        }
        if (!hit) { Py_DECREF(prid); Py_DECREF(drid); continue; }
        Kept *kept = kept_of(k);
        qsort(kept, k->n_kept, sizeof(Kept), cmp_kept_ord);
        PyObject *stages = PyList_New(k->n_kept);
        for (int32_t s = 0; stages && s < k->n_kept; s++) {
            const Kept *e = &kept[s];
            PyObject *step = e->step == NULL_INT ? (Py_INCREF(Py_None), Py_None) : PyLong_FromLongLong(e->step);
            PyObject *ts = isnan(e->ts) ? (Py_INCREF(Py_None), Py_None) : PyFloat_FromDouble(e->ts);
            PyObject *row = step && ts ? Py_BuildValue("(iOiOL)", e->stage, step, e->live, ts, e->ord) : NULL;
            Py_XDECREF(step);
            Py_XDECREF(ts);
            if (!row) { Py_CLEAR(stages); break; }
            PyList_SET_ITEM(stages, s, row);
        }
        PyObject *ptok = k->ptok == NULL_INT ? (Py_INCREF(Py_None), Py_None) : PyLong_FromLongLong(k->ptok);
        PyObject *room = room_str(t, k), *row = NULL;
        if (stages && ptok && room)  /* N: the tuple takes these references */
            row = Py_BuildValue("(LNLNNON)", k->first_d, room, k->attempt, prid, drid, ptok, stages);
        else {
            Py_XDECREF(room);
            Py_DECREF(prid);
            Py_DECREF(drid);
        }
        Py_XDECREF(ptok);
        if (!row) { Py_XDECREF(stages); Py_DECREF(out); return NULL; }
        if (PyList_Append(out, row) < 0) { Py_DECREF(row); Py_DECREF(out); return NULL; }
        Py_DECREF(row);
    }
    return out;
}

static PyObject *table_nbytes(RoomTable *t, void *unused)
{
    /* what the process holds for the table: the index, the entries and record positions in
       use (the arrays' unused tails are never touched, so never resident), the kept stages and
       groups, and the rooms' and rids' text */
    return PyLong_FromSsize_t(t->cap * (Py_ssize_t)sizeof(uint64_t) + t->n * (Py_ssize_t)sizeof(KeyState)
                              + t->kept_bytes + t->n_rec * (Py_ssize_t)(sizeof(uint32_t) + sizeof(long long))
                              + t->text_n);
}

static Py_ssize_t table_len(RoomTable *t) { return t->n; }

static int table_init(RoomTable *t, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"prefill_stage", "max_kept", NULL};
    int prefill_stage, max_kept = 4096;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|i", kwlist, &prefill_stage, &max_kept)) return -1;
    if (max_kept < 1) { PyErr_SetString(PyExc_ValueError, "max_kept must be at least 1"); return -1; }
    t->prefill_stage = prefill_stage;
    t->max_kept = max_kept;
    t->since = t->until = NAN;
    Py_INCREF(Py_None);
    Py_XSETREF(t->instance_ok, Py_None);
    return 0;
}

static void table_dealloc(RoomTable *t)
{
    for (Py_ssize_t i = 0; i < t->n; i++) {
        KeyState *k = &t->keys[i];
        Py_XDECREF(k->p_inst);
        Py_XDECREF(k->p_layout);
        Py_XDECREF(k->d_inst);
        if (k->cap_kept > KEPT_INLINE) free(k->kept.heap);
        free(k->groups);
    }
    free(t->keys);
    Py_XDECREF(t->instance_ok);
    Py_XDECREF(t->instance_seen);
    free(t->text);
    free(t->index);
    free(t->rec_key);
    free(t->rec_ord);
    free(t->sorted);
    free(t->judged);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef table_methods[] = {
    {"add", (PyCFunction)table_add, METH_VARARGS,
     "add(columns, fid=0): fold a scan_chunk's rows of file `fid` (its rank in reading order) into their keys' state; "
     "files and chunks in reading order"},
    {"mark_complex", (PyCFunction)table_mark_complex, METH_O,
     "mark_complex(keys): (room, attempt[, decode, in_window, instance_ok]) of the records the reference reads"},
    {"select", (PyCFunction)table_select, METH_VARARGS,
     "select(since, until, instance_ok): only keys decoded in [since, until) (never decoded: any record in it) "
     "with a record of an instance instance_ok accepts (None: any); NaN: an open end; before any add"},
    {"complex_keys", (PyCFunction)table_complex_keys, METH_NOARGS, "complex_keys() -> [(room, attempt)] of the complex keys"},
    {"judge", (PyCFunction)table_judge, METH_NOARGS,
     "judge() -> {(room, attempt): 'clean' | 'prefill_only' | 'complex'}, as classify.CLASSIFY"},
    {"complex_positions", (PyCFunction)table_complex_positions, METH_NOARGS,
     "complex_positions() -> int64 bytes: the positions of every record of a complex key, in reading order"},
    {"clean_rooms_json", (PyCFunction)table_clean_rooms_json, METH_VARARGS,
     "clean_rooms_json(stages, verdicts, file_names, start=0, stop=all, sep=b'') -> (positions, ends, text, plain): "
     "the clean rooms' JSON (as output._clean_rooms writes it, before json_safe), in order of their first decode "
     "record, rooms start to stop of that order, each line followed by sep (ends: where each line ends, before its "
     "sep; plain: no byte json_safe could escape, DEL or past ASCII)"},
    {"clean_counts", (PyCFunction)table_clean_counts, METH_VARARGS,
     "clean_counts(finish_stage, mismatch, not_comparable) -> {'rooms', 'open', 'live', 'duplicates', "
     "'records', 'first_record', 'prefill_only', 'conflicts', 'first_decode', 'stages'}: the clean keys' counts "
     "summary.merge takes from SQL"},
    {"clean_coverage", (PyCFunction)table_clean_coverage, METH_NOARGS,
     "clean_coverage() -> {(outcome, instance, layout, cells): keys} of the clean keys"},
    {"prefill_only", (PyCFunction)table_prefill_only, METH_NOARGS,
     "prefill_only() -> [(first position, room, attempt, rid or None)] of the clean prefill-only keys, in order"},
    {"timeline", (PyCFunction)table_timeline, METH_NOARGS,
     "timeline() -> [(least decode ts, first decode instance)] of the clean decoded keys with a ts"},
    {"rooms_for_rids", (PyCFunction)table_rooms_for_rids, METH_O,
     "rooms_for_rids(rids) -> the clean decoded keys of these rids, with their kept stages"},
    {"counts", (PyCFunction)table_counts, METH_NOARGS, "counts() -> {'clean': n, 'prefill_only': n, 'complex': n}"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef table_getset[] = {
    {"nbytes", (getter)table_nbytes, NULL, "an estimate of the memory the table holds", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods table_seq = {.sq_length = (lenfunc)table_len};

static PyTypeObject RoomTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ctable.RoomTable",
    .tp_doc = "Each key's (room, attempt) clean-or-complex state, as classify.CLASSIFY judges it.",
    .tp_basicsize = sizeof(RoomTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)table_init,
    .tp_dealloc = (destructor)table_dealloc,
    .tp_methods = table_methods,
    .tp_getset = table_getset,
    .tp_as_sequence = &table_seq,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ctable", "The fleet engine's native room table.", -1, NULL};

PyMODINIT_FUNC PyInit_ctable(void)
{
    if (PyType_Ready(&RoomTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&RoomTableType);
    if (PyModule_AddObject(m, "RoomTable", (PyObject *)&RoomTableType) < 0) {
        Py_DECREF(&RoomTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
