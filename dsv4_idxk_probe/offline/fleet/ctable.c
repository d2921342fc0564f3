/* The fleet engine's native room table (docs/fleet.md, "The native room table").
 *
 * `RoomTable(prefill_stage)` folds the native line pass's rows (`cscan.scan_chunk`'s
 * columns) into one entry per key (room, attempt), in C, with the counts the SQL
 * classification (`classify.CLASSIFY`) takes: prefill and decode records, digest-less ones,
 * whether prefill sent one digest hash with one rid and a digest `pack_digest` accepts, and
 * whether every decode record carries one digest hash. `mark_complex(keys)` adds the keys
 * of records the reference reads (odd lines, slow files). `judge()` then says of each key
 * what the SQL says: clean (decoded, every stage a match), clean prefill-only, or complex.
 * Each entry also keeps the first record of each decode (stage, step), the first decode
 * rid and the prefill tokens, so that `clean_rooms_json` writes every clean room's line
 * of `diff --json` as `output.py` writes it from SQL, in order of its first decode record.
 * Open addressing on the room's str hash and the attempt; an entry holds references to
 * its first room object and its rids. No Python loop per row.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { K_P_DH = 1, K_P_DH_MULTI = 2, K_P_INVALID = 4, K_P_RID = 8, K_P_RID_MULTI = 16,
       K_D_DH = 32, K_D_DH_MULTI = 64, K_COMPLEX = 128 };

#define NULL_INT ((long long)INT64_MIN)  /* the pass's null for integers */
#define LINE_BITS 40                      /* positions.LINE_BITS */

typedef struct {          /* the first record of one decode (stage, step), and how many it has */
    long long step, ord;
    int32_t n;
    int8_t stage, live;
} Kept;

typedef struct {
    PyObject *room;       /* NULL: an empty slot */
    PyObject *p_rid;      /* the first prefill record's rid (Py_None for null) */
    PyObject *d_rid;      /* the first decode record's rid that is not null (NULL: none) */
    long long attempt;
    Py_hash_t hash;
    long long p, d, p_null, d_null;
    long long first_d, ptok;  /* the first decode record's position; the first prefill record's tokens */
    long long d_rid_ord;      /* d_rid's record's position */
    long long first_p;        /* the first prefill record's position */
    uint64_t p_dh, d_dh;
    Kept *kept;
    int32_t n_kept, cap_kept;
    uint8_t flags;
} KeyState;

typedef struct {
    PyObject_HEAD
    KeyState *slots;
    Py_ssize_t cap, n, text_bytes, kept_bytes;
    int prefill_stage;    /* the stage column's value for prefill_send */
} RoomTable;

static Py_hash_t key_hash(Py_hash_t room_hash, long long attempt)
{
    uint64_t h = (uint64_t)room_hash ^ ((uint64_t)attempt * 0x9E3779B185EBCA87ULL);
    h ^= h >> 29;
    Py_hash_t out = (Py_hash_t)h;
    return out == -1 ? -2 : out;
}

/* The slot of (room, attempt): its entry, or the empty slot where it goes; NULL on error. */
static KeyState *find_slot(KeyState *slots, Py_ssize_t cap, PyObject *room, long long attempt, Py_hash_t h)
{
    Py_ssize_t mask = cap - 1, i = (Py_ssize_t)((uint64_t)h & (uint64_t)mask);
    for (;;) {
        KeyState *k = &slots[i];
        if (!k->room) return k;
        if (k->hash == h && k->attempt == attempt) {
            if (k->room == room) return k;
            int eq = PyUnicode_Compare(k->room, room);
            if (eq == -1 && PyErr_Occurred()) return NULL;
            if (eq == 0) return k;
        }
        i = (i + 1) & mask;
    }
}

static int table_grow(RoomTable *t)
{
    Py_ssize_t cap = t->cap ? t->cap * 2 : 1024;
    KeyState *slots = calloc(cap, sizeof(KeyState));
    if (!slots) { PyErr_NoMemory(); return 0; }
    for (Py_ssize_t i = 0; i < t->cap; i++) {
        KeyState *k = &t->slots[i];
        if (!k->room) continue;
        Py_ssize_t j = (Py_ssize_t)((uint64_t)k->hash & (uint64_t)(cap - 1));
        while (slots[j].room) j = (j + 1) & (cap - 1);
        slots[j] = *k;
    }
    free(t->slots);
    t->slots = slots;
    t->cap = cap;
    return 1;
}

/* The entry of (room, attempt), made when new (a strong reference to `room`). */
static KeyState *table_entry(RoomTable *t, PyObject *room, long long attempt)
{
    if (!PyUnicode_Check(room)) { PyErr_SetString(PyExc_TypeError, "a room must be a str"); return NULL; }
    if ((t->n + 1) * 2 > t->cap && !table_grow(t)) return NULL;
    Py_hash_t rh = PyObject_Hash(room);
    if (rh == -1) return NULL;
    Py_hash_t h = key_hash(rh, attempt);
    KeyState *k = find_slot(t->slots, t->cap, room, attempt, h);
    if (!k || k->room) return k;
    memset(k, 0, sizeof *k);
    Py_INCREF(room);
    k->room = room;
    k->attempt = attempt;
    k->hash = h;
    t->n++;
    t->text_bytes += PyUnicode_GET_LENGTH(room);
    return k;
}

static int same_rid(PyObject *a, PyObject *b)
{
    if (a == b) return 1;
    if (a == Py_None || b == Py_None) return 0;
    int eq = PyUnicode_Compare(a, b);
    if (eq == -1 && PyErr_Occurred()) return -1;
    return eq == 0;
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

/* The first record of the row's (stage, step) in the key's kept stages (the earliest position). */
static int keep_stage(RoomTable *t, KeyState *k, int8_t stage, long long step, long long ord, int8_t live)
{
    for (int32_t j = 0; j < k->n_kept; j++) {
        Kept *e = &k->kept[j];
        if (e->stage == stage && e->step == step) {
            if (ord < e->ord) { e->ord = ord; e->live = live; }
            e->n++;
            return 1;
        }
    }
    if (k->n_kept == k->cap_kept) {
        int32_t cap = k->cap_kept ? k->cap_kept * 2 : 4;
        Kept *nk = realloc(k->kept, cap * sizeof(Kept));
        if (!nk) { PyErr_NoMemory(); return 0; }
        t->kept_bytes += (cap - k->cap_kept) * (Py_ssize_t)sizeof(Kept);
        k->kept = nk;
        k->cap_kept = cap;
    }
    k->kept[k->n_kept++] = (Kept){step, ord, 1, stage, live};
    return 1;
}

#define N_COLS 8
static const char *col_names[N_COLS] = {"attempt", "stage", "flags", "dh", "line", "step", "live", "tokens"};
static const Py_ssize_t col_width[N_COLS] = {8, 1, 1, 8, 8, 8, 1, 8};

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
    Py_buffer b[N_COLS];
    int got = 0, ok = 0;
    for (; got < N_COLS; got++)
        if (!column(cols, col_names[got], col_width[got], n, &b[got])) goto done;
    const long long *attempt = b[0].buf, *line = b[4].buf, *step = b[5].buf, *tokens = b[7].buf;
    const int8_t *stage = b[1].buf, *live = b[6].buf;
    const uint8_t *flags = b[2].buf;
    const uint64_t *dh = b[3].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        KeyState *k = table_entry(t, PyList_GET_ITEM(rooms, i), attempt[i]);
        if (!k) goto done;
        int has = flags[i] & 1;
        long long ord = (fid << LINE_BITS) | line[i];
        PyObject *rid = PyList_GET_ITEM(rids, i);
        if (stage[i] == t->prefill_stage) {
            if (k->p++ == 0 || ord < k->first_p) k->first_p = ord;
            if (k->p == 1) k->ptok = tokens[i];
            if (!has) k->p_null++;
            else {
                if (!(flags[i] & 2)) k->flags |= K_P_INVALID;
                if (!(k->flags & K_P_DH)) { k->p_dh = dh[i]; k->flags |= K_P_DH; }
                else if (k->p_dh != dh[i]) k->flags |= K_P_DH_MULTI;
            }
            if (!(k->flags & K_P_RID)) { Py_INCREF(rid); k->p_rid = rid; k->flags |= K_P_RID; }
            else if (!(k->flags & K_P_RID_MULTI)) {
                int same = same_rid(k->p_rid, rid);
                if (same < 0) goto done;
                if (!same) k->flags |= K_P_RID_MULTI;
            }
        } else {
            if (k->d++ == 0 || ord < k->first_d) k->first_d = ord;
            if (!has) k->d_null++;
            else if (!(k->flags & K_D_DH)) { k->d_dh = dh[i]; k->flags |= K_D_DH; }
            else if (k->d_dh != dh[i]) k->flags |= K_D_DH_MULTI;
            if (rid != Py_None && (!k->d_rid || ord < k->d_rid_ord)) {
                Py_INCREF(rid);
                Py_XSETREF(k->d_rid, rid);
                k->d_rid_ord = ord;
            }
            if (!keep_stage(t, k, stage[i], step[i], ord, live[i])) goto done;
        }
    }
    ok = 1;
done:
    for (int j = 0; j < got; j++) PyBuffer_Release(&b[j]);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyObject *table_mark_complex(RoomTable *t, PyObject *keys)
{
    PyObject *it = PyObject_GetIter(keys), *item;
    if (!it) return NULL;
    while ((item = PyIter_Next(it))) {
        PyObject *room;
        long long attempt;
        if (!PyArg_ParseTuple(item, "OL", &room, &attempt)) { Py_DECREF(item); Py_DECREF(it); return NULL; }
        KeyState *k = table_entry(t, room, attempt);
        Py_DECREF(item);
        if (!k) { Py_DECREF(it); return NULL; }
        k->flags |= K_COMPLEX;
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* 0: complex, 1: clean (decoded), 2: clean prefill-only: classify.CLASSIFY's rule. */
static int judgment(const KeyState *k)
{
    if (k->flags & K_COMPLEX) return 0;
    if (k->d > 0 && k->p > 0 && k->p_null == 0 && (k->flags & K_P_DH) && !(k->flags & K_P_DH_MULTI)
        && !(k->flags & K_P_INVALID) && !(k->flags & K_P_RID_MULTI) && k->d_null == 0
        && !(k->flags & K_D_DH_MULTI) && k->d_dh == k->p_dh)
        return 1;
    if (k->d == 0 && k->p > 0 && !(k->flags & K_P_INVALID)) return 2;
    return 0;
}

static PyObject *table_judge(RoomTable *t, PyObject *unused)
{
    static const char *names[3] = {"complex", "clean", "prefill_only"};
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < t->cap; i++) {
        const KeyState *k = &t->slots[i];
        if (!k->room) continue;
        PyObject *key = Py_BuildValue("(OL)", k->room, k->attempt);
        PyObject *v = key ? PyUnicode_FromString(names[judgment(k)]) : NULL;
        if (!v || PyDict_SetItem(out, key, v) < 0) { Py_XDECREF(key); Py_XDECREF(v); Py_DECREF(out); return NULL; }
        Py_DECREF(key);
        Py_DECREF(v);
    }
    return out;
}

static PyObject *table_counts(RoomTable *t, PyObject *unused)
{
    long long c[3] = {0, 0, 0};
    for (Py_ssize_t i = 0; i < t->cap; i++)
        if (t->slots[i].room) c[judgment(&t->slots[i])]++;
    return Py_BuildValue("{sLsLsL}", "complex", c[0], "clean", c[1], "prefill_only", c[2]);
}

/* ---- the clean rooms' JSON, as output._clean_rooms writes it from SQL ---- */

typedef struct { char *p; Py_ssize_t n, cap; } Buf;

static int put(Buf *b, const char *s, Py_ssize_t n)
{
    if (b->n + n > b->cap) {
        Py_ssize_t cap = b->cap ? b->cap : 1 << 16;
        while (cap < b->n + n) cap *= 2;
        char *np = realloc(b->p, cap);
        if (!np) { PyErr_NoMemory(); return 0; }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    return 1;
}
#define PUTS(b, s) put((b), (s), (Py_ssize_t)strlen(s))

static int put_int(Buf *b, long long v)
{
    char tmp[32];
    return put(b, tmp, snprintf(tmp, sizeof tmp, "%lld", v));
}

static int put_str(Buf *b, PyObject *s)  /* a str's UTF-8 bytes (callers quote them) */
{
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    return u && put(b, u, n);
}

static int put_quoted_or_null(Buf *b, PyObject *s)
{
    if (!s || s == Py_None) return PUTS(b, "null");
    return PUTS(b, "\"") && put_str(b, s) && PUTS(b, "\"");
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

static int cmp_first_d(const void *x, const void *y)
{
    const KeyState *a = *(KeyState *const *)x, *b = *(KeyState *const *)y;
    return a->first_d < b->first_d ? -1 : a->first_d > b->first_d;
}

static int room_json(Buf *b, KeyState *k, PyObject *stages, PyObject *verdicts, PyObject *wesc, int finish)
{
    qsort(k->kept, k->n_kept, sizeof(Kept), cmp_kept);
    int closed = 0;
    if (!PUTS(b, "{\"room\":\"") || !put_str(b, k->room) || !PUTS(b, "\",\"attempt\":") || !put_int(b, k->attempt)
        || !PUTS(b, ",\"rid\":{\"prefill\":") || !put_quoted_or_null(b, k->p_rid) || !PUTS(b, ",\"decode\":")
        || !put_quoted_or_null(b, k->d_rid)
        || !PUTS(b, "},\"verdict\":\"match\",\"first_divergence\":null,\"last_match_before\":null,\"stages\":["))
        return 0;
    for (int32_t j = 0; j < k->n_kept; j++) {
        const Kept *e = &k->kept[j];
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

static PyObject *table_clean_rooms_json(RoomTable *t, PyObject *args)
{
    PyObject *stages, *verdicts, *wesc;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyTuple_Type, &stages, &PyTuple_Type, &verdicts, &PyTuple_Type, &wesc))
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
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < t->cap; i++) n += t->slots[i].room && judgment(&t->slots[i]) == 1;
    KeyState **keys = malloc((n ? n : 1) * sizeof(KeyState *));
    long long *ords = malloc((n ? n : 1) * sizeof(long long)), *ends = malloc((n ? n : 1) * sizeof(long long));
    Buf b = {NULL, 0, 0};
    PyObject *result = NULL;
    if (!keys || !ords || !ends) { PyErr_NoMemory(); goto out; }
    n = 0;
    for (Py_ssize_t i = 0; i < t->cap; i++)
        if (t->slots[i].room && judgment(&t->slots[i]) == 1) keys[n++] = &t->slots[i];
    qsort(keys, n, sizeof(KeyState *), cmp_first_d);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!room_json(&b, keys[i], stages, verdicts, wesc, finish)) goto out;
        ords[i] = keys[i]->first_d;
        ends[i] = b.n;
    }
    result = Py_BuildValue("(y#y#y#)", (const char *)ords, n * (Py_ssize_t)sizeof(long long),
                           (const char *)ends, n * (Py_ssize_t)sizeof(long long), b.p ? b.p : "", b.n);
out:
    free(keys);
    free(ords);
    free(ends);
    free(b.p);
    return result;
}

/* The counts summary.merge takes from SQL for the clean keys: rooms, open rooms (no
 * decode_finish), kept stages whose live verdict is mismatch or not_comparable, duplicate
 * records (decode records past the first of their (stage, step), prefill records past the
 * first), and the records of every clean key (prefill-only ones too) with the first one's
 * position. */
static PyObject *table_clean_counts(RoomTable *t, PyObject *args)
{
    int finish, live_mismatch, live_nc;
    if (!PyArg_ParseTuple(args, "iii", &finish, &live_mismatch, &live_nc)) return NULL;
    long long rooms = 0, open = 0, live = 0, dups = 0, records = 0, first = -1;
    for (Py_ssize_t i = 0; i < t->cap; i++) {
        const KeyState *k = &t->slots[i];
        if (!k->room) continue;
        int j = judgment(k);
        if (!j) continue;
        records += k->p + k->d;
        long long f = k->d && k->first_d < k->first_p ? k->first_d : k->first_p;
        if (first < 0 || f < first) first = f;
        if (j != 1) continue;
        rooms++;
        dups += k->p - 1;
        int closed = 0;
        for (int32_t s = 0; s < k->n_kept; s++) {
            const Kept *e = &k->kept[s];
            closed |= e->stage == finish;
            live += e->live == live_mismatch || e->live == live_nc;
            dups += e->n - 1;
        }
        open += !closed;
    }
    return Py_BuildValue("{sLsLsLsLsLsL}", "rooms", rooms, "open", open, "live", live, "duplicates", dups,
                         "records", records, "first_record", first);
}

static PyObject *table_nbytes(RoomTable *t, void *unused)
{
    /* the slots, the kept stages, and about a str object per room (header + text) */
    return PyLong_FromSsize_t(t->cap * (Py_ssize_t)sizeof(KeyState) + t->kept_bytes + t->n * 64 + t->text_bytes);
}

static Py_ssize_t table_len(RoomTable *t) { return t->n; }

static int table_init(RoomTable *t, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"prefill_stage", NULL};
    int prefill_stage;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", kwlist, &prefill_stage)) return -1;
    t->prefill_stage = prefill_stage;
    return 0;
}

static void table_dealloc(RoomTable *t)
{
    for (Py_ssize_t i = 0; i < t->cap; i++) {
        Py_XDECREF(t->slots[i].room);
        Py_XDECREF(t->slots[i].p_rid);
        Py_XDECREF(t->slots[i].d_rid);
        free(t->slots[i].kept);
    }
    free(t->slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef table_methods[] = {
    {"add", (PyCFunction)table_add, METH_VARARGS,
     "add(columns, fid=0): fold a scan_chunk's rows of file `fid` (its rank in reading order) into their keys' state"},
    {"mark_complex", (PyCFunction)table_mark_complex, METH_O,
     "mark_complex(keys): (room, attempt) pairs the reference reads a record of"},
    {"judge", (PyCFunction)table_judge, METH_NOARGS,
     "judge() -> {(room, attempt): 'clean' | 'prefill_only' | 'complex'}, as classify.CLASSIFY"},
    {"clean_rooms_json", (PyCFunction)table_clean_rooms_json, METH_VARARGS,
     "clean_rooms_json(stages, verdicts, file_names) -> (positions, ends, text): the clean rooms' JSON "
     "(as output._clean_rooms writes it, before json_safe), in order of their first decode record"},
    {"clean_counts", (PyCFunction)table_clean_counts, METH_VARARGS,
     "clean_counts(finish_stage, mismatch, not_comparable) -> {'rooms', 'open', 'live', 'duplicates', "
     "'records', 'first_record'}: the clean keys' counts summary.merge takes from SQL"},
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
