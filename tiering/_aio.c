/* tiering._aio: a kernel AIO queue driven from C, so that the disk is fed without the GIL.

A Python reaper thread needs the GIL after every io_getevents to refill the queue; while the training thread holds it
(Python, hooks, kernel launches: most of a GPU step) the reaper waits up to the interpreter's switch interval per
completion and the disk drains (bench/RESULTS.md, session 32: reads at 0.76x, writes at 0.63x of fio's rate with
one Python-bound thread beside them).
Here the reaper is a pthread: it waits in io_getevents, records each completion and submits the next blocks into the
freed slots, all without the GIL. Python hands blocks in with `submit` and takes completions with `wait_done` (on a
thread of its own, which runs the callbacks): neither is on the path that keeps the disk busy.

Raw syscalls (linux/aio_abi.h), so no libaio.so is needed. One Queue per open file's engine.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/aio_abi.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    long long token;
    int write;
    int fd;
    unsigned long long address;
    unsigned long long nbytes;
    long long offset;
} Block;

typedef struct {
    long long token;
    long long result; /* bytes moved, or -errno */
} Done;

typedef struct {
    PyObject_HEAD
    aio_context_t ctx;
    int depth;
    struct iocb *iocbs;
    struct iocb **batch;
    struct io_event *events;
    long long *slot_token;
    int *free_slots;
    int nfree;
    Block *pending; /* a ring */
    size_t pending_cap, pending_head, pending_len;
    Done *done;
    size_t done_cap, done_len;
    int inflight;
    int single_submit;  /* one io_submit call per block */
    int overlap_events; /* refill as each completion arrives; 0: only once the whole batch is done */
    int closing;   /* no more submits; the reaper ends once nothing is pending or in flight */
    int exited;    /* the reaper has ended: wait_done returns [] once the done list is empty */
    int started;
    pid_t owner; /* a forked child has neither the reaper nor the AIO context: it may not use the queue */
    pthread_mutex_t lock;
    pthread_cond_t work; /* the reaper waits here while nothing is in flight */
    pthread_cond_t ready; /* wait_done waits here for completions */
    pthread_t reaper;
} Queue;

static long sys_io_setup(unsigned nr, aio_context_t *ctx) { return syscall(SYS_io_setup, nr, ctx); }
static long sys_io_destroy(aio_context_t ctx) { return syscall(SYS_io_destroy, ctx); }
static long sys_io_submit(aio_context_t ctx, long n, struct iocb **iocbs) { return syscall(SYS_io_submit, ctx, n, iocbs); }
static long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event *events) {
    return syscall(SYS_io_getevents, ctx, min_nr, nr, events, NULL);
}

/* With the lock held. Room for every completion owed (submit reserves it), so a completion is never dropped. */
static void push_done(Queue *q, long long token, long long result) {
    q->done[q->done_len++] = (Done){token, result};
}

/* With the lock held: room in the done list for everything owed a completion once n more blocks are queued.
   0, or -1 where memory ran out (the submit fails; nothing queued). */
static int reserve_done(Queue *q, size_t n) {
    size_t need = q->done_len + (size_t)q->inflight + q->pending_len + n;
    if (need <= q->done_cap) return 0;
    size_t cap = q->done_cap ? q->done_cap : 64;
    while (cap < need) cap *= 2;
    Done *grown = realloc(q->done, cap * sizeof(Done));
    if (!grown) return -1;
    q->done = grown;
    q->done_cap = cap;
    return 0;
}

/* With the lock held: put the batch's blocks from `first` on back at the front of the pending ring, in order, their
   slots freed (they left the ring in this pump, so it has room for them). */
static void unqueue(Queue *q, int first, int n) {
    for (int i = n - 1; i >= first; i--) {
        struct iocb *cb = q->batch[i];
        int slot = (int)cb->aio_data;
        q->pending_head = (q->pending_head + q->pending_cap - 1) % q->pending_cap;
        q->pending[q->pending_head] = (Block){q->slot_token[slot], cb->aio_lio_opcode == IOCB_CMD_PWRITE,
                                              (int)cb->aio_fildes, cb->aio_buf, cb->aio_nbytes, cb->aio_offset};
        q->pending_len++;
        q->free_slots[q->nfree++] = slot;
    }
}

/* With the lock held: move pending blocks into free slots and submit them, until the slots or the blocks run out. A
   block the kernel refuses outright completes at once with -errno, as a failed transfer would, and its slot takes
   the next (every block gets its completion, even where nothing is in flight to pump again); EAGAIN while others
   are in flight is the kernel short of room for now: the rest wait for the next completion. */
static void pump(Queue *q) {
    while (q->nfree && q->pending_len && (q->overlap_events || !q->inflight)) {
        int n = 0;
        while (q->nfree && q->pending_len) {
            Block *b = &q->pending[q->pending_head];
            q->pending_head = (q->pending_head + 1) % q->pending_cap;
            q->pending_len--;
            int slot = q->free_slots[--q->nfree];
            struct iocb *cb = &q->iocbs[slot];
            memset(cb, 0, sizeof(*cb));
            cb->aio_lio_opcode = b->write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
            cb->aio_fildes = (uint32_t)b->fd;
            cb->aio_buf = b->address;
            cb->aio_nbytes = b->nbytes;
            cb->aio_offset = b->offset;
            cb->aio_data = (uint64_t)slot;
            q->slot_token[slot] = b->token;
            q->batch[n++] = cb;
        }
        int submitted = 0;
        while (submitted < n) {
            long r = sys_io_submit(q->ctx, q->single_submit ? 1 : n - submitted, q->batch + submitted);
            if (r > 0) {
                q->inflight += (int)r;
                submitted += (int)r;
                continue;
            }
            int err = r == 0 ? EAGAIN : errno;
            if (err == EAGAIN && q->inflight) {
                unqueue(q, submitted, n);
                goto out;
            }
            int slot = (int)q->batch[submitted]->aio_data;
            push_done(q, q->slot_token[slot], -(long long)err);
            q->free_slots[q->nfree++] = slot;
            submitted++;
        }
    }
out:
    if (q->inflight) pthread_cond_signal(&q->work);
    if (q->done_len) pthread_cond_signal(&q->ready);
}

/* io_getevents failed for good: everything owed a completion fails with its errno, and so does every later submit.
   The caller destroyed the context first (io_destroy waits for what is in flight): no failed block's buffer is
   still being written by the kernel when its caller takes it back. */
static void fail_all(Queue *q, int err) {
    for (int slot = 0; slot < q->depth; slot++) {
        int free_ = 0;
        for (int i = 0; i < q->nfree; i++) free_ |= q->free_slots[i] == slot;
        if (!free_) push_done(q, q->slot_token[slot], -(long long)err);
    }
    while (q->pending_len) {
        push_done(q, q->pending[q->pending_head].token, -(long long)err);
        q->pending_head = (q->pending_head + 1) % q->pending_cap;
        q->pending_len--;
    }
    q->inflight = 0;
    q->closing = 1;
}

static void *reap(void *arg) {
    Queue *q = arg;
    pthread_mutex_lock(&q->lock);
    for (;;) {
        while (!q->inflight) {
            if (q->closing && !q->pending_len) goto out;
            pthread_cond_wait(&q->work, &q->lock);
        }
        pthread_mutex_unlock(&q->lock);
        long n = sys_io_getevents(q->ctx, 1, q->depth, q->events); /* returns once one or more are done */
        int err = errno;
        pthread_mutex_lock(&q->lock);
        if (n < 0) {
            if (err == EINTR) continue;
            q->closing = 1; /* no submit while the lock is let go */
            pthread_mutex_unlock(&q->lock);
            sys_io_destroy(q->ctx);
            pthread_mutex_lock(&q->lock);
            q->ctx = 0;
            fail_all(q, err);
            goto out;
        }
        for (long i = 0; i < n; i++) {
            int slot = (int)q->events[i].data;
            push_done(q, q->slot_token[slot], (long long)q->events[i].res);
            q->free_slots[q->nfree++] = slot;
        }
        q->inflight -= (int)n;
        pump(q);
        pthread_cond_signal(&q->ready);
    }
out:
    q->exited = 1;
    pthread_cond_broadcast(&q->ready);
    pthread_mutex_unlock(&q->lock);
    return NULL;
}

/* Refuse further submits and join the reaper once nothing is pending or in flight (the GIL released). */
static void stop(Queue *q) {
    if (!q->started || getpid() != q->owner) return;
    q->started = 0; /* under the GIL: a second close meanwhile joins nothing */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->lock);
    q->closing = 1;
    pthread_cond_signal(&q->work);
    pthread_mutex_unlock(&q->lock);
    pthread_join(q->reaper, NULL);
    Py_END_ALLOW_THREADS
}

static void Queue_dealloc(Queue *q) {
    stop(q);
    if (q->ctx && getpid() == q->owner) sys_io_destroy(q->ctx);
    pthread_mutex_destroy(&q->lock);
    pthread_cond_destroy(&q->work);
    pthread_cond_destroy(&q->ready);
    free(q->iocbs); free(q->batch); free(q->events); free(q->slot_token); free(q->free_slots);
    free(q->pending); free(q->done);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static int Queue_init(Queue *q, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"depth", "single_submit", "overlap_events", NULL};
    int depth, single_submit = 0, overlap_events = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|pp", kwlist, &depth, &single_submit, &overlap_events)) return -1;
    if (q->started || q->iocbs) {
        PyErr_SetString(PyExc_RuntimeError, "Queue is initialized once");
        return -1;
    }
    if (depth < 1) {
        PyErr_SetString(PyExc_ValueError, "depth must be at least 1");
        return -1;
    }
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->work, NULL);
    pthread_cond_init(&q->ready, NULL);
    q->owner = getpid();
    q->depth = depth;
    q->single_submit = single_submit;
    q->overlap_events = overlap_events;
    q->iocbs = calloc(depth, sizeof(struct iocb));
    q->batch = calloc(depth, sizeof(struct iocb *));
    q->events = calloc(depth, sizeof(struct io_event));
    q->slot_token = calloc(depth, sizeof(long long));
    q->free_slots = calloc(depth, sizeof(int));
    q->pending_cap = 256;
    q->pending = calloc(q->pending_cap, sizeof(Block));
    if (!q->iocbs || !q->batch || !q->events || !q->slot_token || !q->free_slots || !q->pending) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < depth; i++) q->free_slots[i] = depth - 1 - i;
    q->nfree = depth;
    if (sys_io_setup((unsigned)depth, &q->ctx) < 0) {
        q->ctx = 0;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    int err = pthread_create(&q->reaper, NULL, reap, q);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    q->started = 1;
    return 0;
}

/* A forked child has neither the reaper nor the AIO context: RuntimeError (returns 1) rather than a child that
   waits forever for completions nobody reaps. */
static int not_owner(Queue *q) {
    if (getpid() == q->owner) return 0;
    PyErr_Format(PyExc_RuntimeError, "the AIO queue belongs to process %d: a forked child cannot use it",
                 (int)q->owner);
    return 1;
}

/* submit(blocks): blocks is a list of (token, write, fd, address, nbytes, offset). */
static PyObject *Queue_submit(Queue *q, PyObject *blocks) {
    /* A tuple of them: what an item's conversion runs (an __index__) cannot resize it or free an item under us. */
    PyObject *seq = PySequence_Tuple(blocks);
    if (!seq) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    Block *parsed = n ? malloc(n * sizeof(Block)) : NULL;
    if (n && !parsed) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Block *b = &parsed[i];
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(seq, i), "LiiKKL;a block is (token, write, fd, address, "
                              "nbytes, offset)", &b->token, &b->write, &b->fd, &b->address, &b->nbytes, &b->offset)) {
            free(parsed);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    if (not_owner(q)) {
        free(parsed);
        return NULL;
    }
    int closed = 0, nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->lock);
    if (q->closing) {
        closed = 1;
    } else if (reserve_done(q, (size_t)n)) {
        nomem = 1;
    } else if (q->pending_len + (size_t)n > q->pending_cap) {
        size_t cap = q->pending_cap;
        while (q->pending_len + (size_t)n > cap) cap *= 2;
        Block *grown = malloc(cap * sizeof(Block));
        if (!grown) {
            nomem = 1;
        } else {
            for (size_t i = 0; i < q->pending_len; i++) grown[i] = q->pending[(q->pending_head + i) % q->pending_cap];
            free(q->pending);
            q->pending = grown;
            q->pending_cap = cap;
            q->pending_head = 0;
        }
    }
    if (!closed && !nomem) {
        for (Py_ssize_t i = 0; i < n; i++) {
            q->pending[(q->pending_head + q->pending_len) % q->pending_cap] = parsed[i];
            q->pending_len++;
        }
        pump(q);
    }
    pthread_mutex_unlock(&q->lock);
    Py_END_ALLOW_THREADS
    free(parsed);
    if (closed) {
        PyErr_SetString(PyExc_RuntimeError, "the AIO queue is closed");
        return NULL;
    }
    if (nomem) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* wait_done(): the completions since the last call, as [(token, result)], waiting (without the GIL) for at least
   one; [] once the queue is closed and every completion was taken. Where memory runs out, MemoryError, and the
   completions stay queued for the next call: they leave the queue only once handed over. One thread calls it. */
static PyObject *Queue_wait_done(Queue *q, PyObject *unused) {
    Done *taken = NULL;
    size_t ntaken = 0, room = 0;
    int nomem = 0;
    if (not_owner(q)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->lock);
    for (;;) {
        while (!q->done_len && !q->exited) pthread_cond_wait(&q->ready, &q->lock);
        if (q->done_len <= room) break;
        size_t want = q->done_len;
        pthread_mutex_unlock(&q->lock);
        Done *grown = realloc(taken, want * sizeof(Done));
        pthread_mutex_lock(&q->lock);
        if (!grown) {
            nomem = 1;
            break;
        }
        taken = grown;
        room = want;
    }
    if (!nomem) {
        ntaken = q->done_len;
        if (ntaken) memcpy(taken, q->done, ntaken * sizeof(Done));
    }
    pthread_mutex_unlock(&q->lock);
    Py_END_ALLOW_THREADS
    if (nomem) {
        free(taken);
        return PyErr_NoMemory();
    }
    PyObject *out = PyList_New((Py_ssize_t)ntaken);
    for (size_t i = 0; out && i < ntaken; i++) {
        PyObject *pair = Py_BuildValue("(LL)", taken[i].token, taken[i].result);
        if (!pair) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, pair);
    }
    free(taken);
    if (out && ntaken) { /* handed over: off the front of the list (the reaper may have added more behind) */
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&q->lock);
        q->done_len -= ntaken;
        memmove(q->done, q->done + ntaken, q->done_len * sizeof(Done));
        pthread_mutex_unlock(&q->lock);
        Py_END_ALLOW_THREADS
    }
    return out;
}

/* close(): no more submits; waits (without the GIL) until everything submitted has completed. */
static PyObject *Queue_close(Queue *q, PyObject *unused) {
    stop(q);
    Py_RETURN_NONE;
}

static PyMethodDef Queue_methods[] = {
    {"submit", (PyCFunction)Queue_submit, METH_O, "Queue blocks: a list of (token, write, fd, address, nbytes, offset)."},
    {"wait_done", (PyCFunction)Queue_wait_done, METH_NOARGS, "Completions [(token, bytes moved or -errno)]."},
    {"close", (PyCFunction)Queue_close, METH_NOARGS, "Refuse further submits and wait for everything in flight."},
    {NULL},
};

static PyTypeObject QueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tiering._aio.Queue",
    .tp_basicsize = sizeof(Queue),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Kernel AIO with a C reaper: submits and reaps without the GIL.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Queue_init,
    .tp_dealloc = (destructor)Queue_dealloc,
    .tp_methods = Queue_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tiering._aio", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__aio(void) {
    if (PyType_Ready(&QueueType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&QueueType);
    if (PyModule_AddObject(m, "Queue", (PyObject *)&QueueType) < 0) {
        Py_DECREF(&QueueType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
