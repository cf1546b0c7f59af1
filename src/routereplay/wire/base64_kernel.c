/* routereplay.wire._base64_kernel: strict base64 decoding at memory speed, for engine route payloads.
 *
 * Built at install beside the set codec's kernel (setup.py, optional). `routereplay.wire.payload`'s
 * b64_to_bytes uses it as a fast path only: text it accepts is text `base64.b64decode(validate=True)`
 * accepts, with the same bytes; anything else goes to `base64.b64decode`, which names the fault.
 *
 * decode(text) -> bytes | None
 *     text: an ASCII str (read in place, no copy) or a bytes-like; any other str gives None. Accepted: a length that is a multiple of 4, every character in the
 *     standard alphabet [A-Za-z0-9+/], except at most two '=' at the very end. Returns the decoded
 *     bytes (bits past the last whole byte are ignored, as binascii does), or None when not accepted.
 *
 * CPython's binascii decodes about 0.5 GB of text a second here; this table walk does 4 characters
 * into 3 bytes with four reads of a 256-entry table and one OR to catch any invalid character.
 * The GIL is released while it runs; no state outlives a call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define INVALID 0x100u /* OR-ed into the group: any invalid character sets this bit */

typedef struct {
    uint32_t value[256]; /* 6-bit value of each character, INVALID for others (and for '=') */
} Alphabet;

static void alphabet_init(Alphabet *a) {
    static const char symbols[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 256; i++) a->value[i] = INVALID << 18;
    for (int i = 0; i < 64; i++) a->value[(unsigned char)symbols[i]] = (uint32_t)i;
}

/* Decode `groups` whole groups of 4 characters; returns 0 when every character was in the alphabet. */
static uint32_t decode_groups(const Alphabet *a, const unsigned char *in, Py_ssize_t groups, unsigned char *out) {
    uint32_t bad = 0;
    for (Py_ssize_t g = 0; g < groups; g++) {
        const unsigned char *c = in + 4 * g;
        uint32_t v0 = a->value[c[0]], v1 = a->value[c[1]], v2 = a->value[c[2]], v3 = a->value[c[3]];
        bad |= v0 | v1 | v2 | v3;
        uint32_t word = (v0 << 18) | (v1 << 12) | (v2 << 6) | v3;
        out[3 * g] = (unsigned char)(word >> 16);
        out[3 * g + 1] = (unsigned char)(word >> 8);
        out[3 * g + 2] = (unsigned char)word;
    }
    return bad & ~(uint32_t)63; /* any bit above the 6 value bits: an invalid character */
}

static PyObject *decode_entry(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_buffer text = {0};
    const unsigned char *in;
    Py_ssize_t n;
    PyObject *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    if (PyUnicode_Check(obj)) {
        if (PyUnicode_READY(obj) < 0) return NULL;
        if (!PyUnicode_IS_ASCII(obj)) Py_RETURN_NONE;
        in = (const unsigned char *)PyUnicode_DATA(obj);
        n = PyUnicode_GET_LENGTH(obj);
    } else {
        if (PyObject_GetBuffer(obj, &text, PyBUF_SIMPLE) < 0) return NULL;
        in = (const unsigned char *)text.buf;
        n = text.len;
    }
    if (n % 4) goto refuse;
    int padding = 0;
    if (n && in[n - 1] == '=') padding = (n >= 2 && in[n - 2] == '=') ? 2 : 1;
    Py_ssize_t groups = n / 4, full = padding ? groups - 1 : groups;
    Py_ssize_t size = 3 * groups - padding;
    result = PyBytes_FromStringAndSize(NULL, size);
    if (!result) goto done;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    Alphabet alphabet;
    alphabet_init(&alphabet);
    uint32_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = decode_groups(&alphabet, in, full, out);
    Py_END_ALLOW_THREADS
    if (padding) { /* the last group: 2 or 3 characters, then '=' */
        const unsigned char *c = in + 4 * full;
        uint32_t v0 = alphabet.value[c[0]], v1 = alphabet.value[c[1]];
        uint32_t v2 = padding == 1 ? alphabet.value[c[2]] : 0;
        bad |= (v0 | v1 | v2) & ~(uint32_t)63;
        uint32_t word = (v0 << 18) | (v1 << 12) | (v2 << 6);
        out[3 * full] = (unsigned char)(word >> 16);
        if (padding == 1) out[3 * full + 1] = (unsigned char)(word >> 8);
    }
    if (!bad) goto done;
    Py_DECREF(result);
refuse:
    result = Py_None;
    Py_INCREF(result);
done:
    if (text.obj) PyBuffer_Release(&text);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode_entry, METH_VARARGS, "Strict base64 to bytes, or None when not accepted (see the module)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_base64_kernel", "Strict base64 decoding for route payloads.", -1, methods, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC PyInit__base64_kernel(void) { return PyModule_Create(&module); }
