/* log-path-model.c: the commit log's data path with no Python in it, to tell what the
 * design costs the event loop from what the Python broker adds
 * (docs/benchmarks-history.md, stop 21).
 *
 * Two threads, pinned to CPUs 0 and 1, as the broker's event loop and log writer:
 * - the "loop" does WORK steps of arithmetic and NWS reads of random cache lines of a WS KiB
 *   working set per message (the interpreter's share), then copies the MSG-byte payload
 *   into the current epoch buffer (EPOCH KiB) behind a HDR-byte gap (a record's topic and
 *   client id); a full epoch is sealed to the writer's queue and the next buffer is taken
 *   from a LIFO free stack, as `store._epoch` takes them from its pool;
 * - the "writer" wakes every GATHER us, takes the sealed epochs and, by MODE,
 *     0: hands them straight back,
 *     1: reads each with CRC-32C first (as `_encode` takes each record's checksum),
 *     2: and then write()s it to a file in the current directory (the page cache),
 *     3: write()s it only: the loop takes each payload's CRC-32C (three chains) as it
 *        copies it, so the writer's core never reads a payload before the kernel does,
 *   then pushes them on the free stack. MODE -1: no writer; the loop reuses its buffer.
 *
 * Prints the loop's CPU per message (thread CPU time, less any wait for a free buffer)
 * and the writer's. Build and run (all sizes in bytes or KiB as named):
 *   gcc -O2 -msse4.2 -pthread scripts/log-path-model.c -o /tmp/log-path-model
 *   /tmp/log-path-model MSG EPOCH_KIB POOL GATHER_US MODE NMSG WS_KIB WORK NWS HDR
 *   e.g. /tmp/log-path-model 4096 256 260 2000 2 200000 2048 1500 150 21
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <nmmintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static long WORK, NWS, HDR, GATHER;
static size_t MSG, EPOCH, POOL, NMSG, WS;
static int MODE;
static char **bufs;
static long *sealed, *freed, sealed_head, sealed_tail, nfree;
static int done;
static double writer_cpu;
static volatile uint32_t sink;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double wall_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static uint32_t crc32c(const char *p, size_t n) {
    uint64_t c = 0;
    for (size_t i = 0; i + 8 <= n; i += 8)
        c = _mm_crc32_u64(c, *(const uint64_t *)(p + i));
    return (uint32_t)c;
}

static uint32_t crc3(const char *p, size_t n) {  /* three chains, as _encode's payload CRC */
    uint64_t a = 0, b = 0, c = 0;
    size_t t = n / 3 & ~7ul;
    for (size_t i = 0; i + 8 <= t; i += 8) {
        a = _mm_crc32_u64(a, *(const uint64_t *)(p + i));
        b = _mm_crc32_u64(b, *(const uint64_t *)(p + t + i));
        c = _mm_crc32_u64(c, *(const uint64_t *)(p + 2 * t + i));
    }
    return (uint32_t)(a ^ b ^ c);
}

static void *writer(void *arg) {
    (void)arg;
    pin(1);
    int fd = open("log-path-model.out", O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) { perror("open"); exit(1); }
    size_t written = 0;
    long *take = malloc(POOL * sizeof(long));
    double c0 = cpu_now();
    for (;;) {
        pthread_mutex_lock(&mu);
        long n = 0;
        while (sealed_tail < sealed_head) take[n++] = sealed[(sealed_tail++) % POOL];
        int stop = done;
        pthread_mutex_unlock(&mu);
        if (!n) {
            if (stop) break;
            usleep(GATHER ? GATHER : 50);
            continue;
        }
        for (long k = 0; k < n; k++) {
            char *b = bufs[take[k]];
            if (MODE == 1 || MODE == 2) sink += crc32c(b, EPOCH);
            if (MODE >= 2) {
                if (write(fd, b, EPOCH) != (ssize_t)EPOCH) { perror("write"); exit(1); }
                written += EPOCH;
                if (written > (512u << 20)) {  /* keep the file (and the disk) small */
                    if (ftruncate(fd, 0) || lseek(fd, 0, SEEK_SET)) { perror("truncate"); exit(1); }
                    written = 0;
                }
            }
        }
        pthread_mutex_lock(&mu);
        for (long k = 0; k < n; k++) freed[nfree++] = take[k];
        pthread_mutex_unlock(&mu);
        if (GATHER) usleep(GATHER);
    }
    writer_cpu = cpu_now() - c0;
    close(fd);
    unlink("log-path-model.out");
    free(take);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 11) {
        fprintf(stderr, "usage: %s MSG EPOCH_KIB POOL GATHER_US MODE NMSG WS_KIB WORK NWS HDR\n", argv[0]);
        return 2;
    }
    MSG = atol(argv[1]); EPOCH = (size_t)atol(argv[2]) << 10; POOL = atol(argv[3]);
    GATHER = atol(argv[4]); MODE = atoi(argv[5]); NMSG = atol(argv[6]);
    WS = (size_t)atol(argv[7]) << 10; WORK = atol(argv[8]); NWS = atol(argv[9]); HDR = atol(argv[10]);
    bufs = malloc(POOL * sizeof(char *));
    sealed = malloc(POOL * sizeof(long));
    freed = malloc(POOL * sizeof(long));
    for (size_t i = 0; i < POOL; i++) {
        bufs[i] = aligned_alloc(4096, EPOCH);
        memset(bufs[i], 1, EPOCH);  /* touched first, as the broker fills its pool */
        freed[nfree++] = POOL - 1 - i;
    }
    char *ws = malloc(WS + 64);
    memset(ws, 2, WS);
    char *src[8];
    for (int i = 0; i < 8; i++) { src[i] = malloc(MSG); memset(src[i], 3, MSG); }
    pthread_t th;
    if (MODE >= 0) pthread_create(&th, NULL, writer, NULL);
    pin(0);
    long cur = freed[--nfree];
    double c0 = cpu_now(), w0 = wall_now(), waited = 0;
    long waits = 0;
    size_t pos = 0;
    uint64_t x = 88172645463325252ull;
    uint32_t acc = 0;
    for (size_t i = 0; i < NMSG; i++) {
        for (long j = 0; j < NWS; j++) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            acc += ws[(x % WS) & ~63ul];
        }
        for (long j = 0; j < WORK; j++) { x ^= x << 13; x ^= x >> 7; x ^= x << 17; }
        acc += x & 1;
        if (pos + MSG + HDR > EPOCH) {  /* seal */
            pos = 0;
            if (MODE >= 0) {
                pthread_mutex_lock(&mu);
                sealed[(sealed_head++) % POOL] = cur;
                if (!nfree) {
                    double s0 = wall_now();
                    waits++;
                    while (!nfree) { pthread_mutex_unlock(&mu); sched_yield(); pthread_mutex_lock(&mu); }
                    waited += wall_now() - s0;
                }
                cur = freed[--nfree];
                pthread_mutex_unlock(&mu);
            }
        }
        memcpy(bufs[cur] + pos + HDR, src[i & 7], MSG);
        if (MODE == 3) acc += crc3(src[i & 7], MSG);
        pos += MSG + HDR;
    }
    double c1 = cpu_now(), w1 = wall_now();
    pthread_mutex_lock(&mu);
    done = 1;
    pthread_mutex_unlock(&mu);
    if (MODE >= 0) pthread_join(th, NULL);
    printf("msg %zu epoch %zuK pool %zu gather %ld us mode %d: loop %.3f us/msg (wall %.3f, %ld waits)"
           " writer %.3f us/msg (%u)\n", MSG, EPOCH >> 10, POOL, GATHER, MODE,
           (c1 - c0 - waited) / NMSG * 1e6, (w1 - w0) / NMSG * 1e6, waits, writer_cpu / NMSG * 1e6, acc & 1);
    return 0;
}
