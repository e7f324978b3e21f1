# C declarations for _encode.py when setup.py compiles it (Cython's augmenting .pxd).
#
# CRC-32C for the checksums of the batch encoder, in C so that it runs without the GIL:
# `crc32c.crc32c` computes the same, but each call goes through Python's argument parsing
# and buffer protocol, which cost more than the checksum of a 1 KiB payload (about 550
# machine instructions per record), and needs the GIL. With the
# SSE 4.2 instruction where the CPU has it (checked at import), else a portable
# table-driven loop (slicing by 8); the tests require the bytes of the reference encoder,
# whose checksums are `crc32c`'s, both ways.

cdef extern from *:
    """
    #include <stddef.h>
    #include <stdint.h>
    #include <string.h>
    /* The portable CRC-32C (reflected, polynomial 0x82F63B78), slicing by 8 bytes on a
       little-endian machine (format.py requires one). */
    static uint32_t wrenmq_crc_tab[8][256];
    static void wrenmq_crc_tables(void) {
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
            wrenmq_crc_tab[0][i] = c;
        }
        for (uint32_t i = 0; i < 256; i++)
            for (int t = 1; t < 8; t++)
                wrenmq_crc_tab[t][i] = (wrenmq_crc_tab[t - 1][i] >> 8)
                                       ^ wrenmq_crc_tab[0][wrenmq_crc_tab[t - 1][i] & 0xff];
    }
    static uint32_t wrenmq_crc32c_sw(uint32_t crc, const char *data, size_t n) {
        const unsigned char *p = (const unsigned char *)data;
        uint32_t c = ~crc;
        uint64_t v;
        while (n >= 8) {
            memcpy(&v, p, 8);
            v ^= c;
            c = wrenmq_crc_tab[7][v & 0xff] ^ wrenmq_crc_tab[6][(v >> 8) & 0xff]
                ^ wrenmq_crc_tab[5][(v >> 16) & 0xff] ^ wrenmq_crc_tab[4][(v >> 24) & 0xff]
                ^ wrenmq_crc_tab[3][(v >> 32) & 0xff] ^ wrenmq_crc_tab[2][(v >> 40) & 0xff]
                ^ wrenmq_crc_tab[1][(v >> 48) & 0xff] ^ wrenmq_crc_tab[0][v >> 56];
            p += 8;
            n -= 8;
        }
        while (n--) c = wrenmq_crc_tab[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        return ~c;
    }
    static uint32_t wrenmq_crc32c_two_sw(uint32_t crc, uint32_t *region, const char *data, size_t n) {
        *region = wrenmq_crc32c_sw(*region, data, n);
        return wrenmq_crc32c_sw(crc, data, n);
    }
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    #include <nmmintrin.h>
    __attribute__((target("sse4.2")))
    static uint32_t wrenmq_crc32c_hw(uint32_t crc, const char *data, size_t n) {
        const unsigned char *p = (const unsigned char *)data;
        uint64_t c = (uint32_t)~crc;
        uint64_t v;
        while (n >= 8) {
            memcpy(&v, p, 8);
            c = _mm_crc32_u64(c, v);
            p += 8;
            n -= 8;
        }
        uint32_t c32 = (uint32_t)c;
        while (n--) c32 = _mm_crc32_u8(c32, *p++);
        return ~c32;
    }
    /* The record's checksum (from `crc`) and, in the same pass, the running checksum of
       all payloads (`*region`): two independent chains of the instruction, which take
       the time of one. */
    __attribute__((target("sse4.2")))
    static uint32_t wrenmq_crc32c_two_hw(uint32_t crc, uint32_t *region, const char *data, size_t n) {
        const unsigned char *p = (const unsigned char *)data;
        uint64_t a = (uint32_t)~crc, b = (uint32_t)~*region;
        uint64_t v;
        while (n >= 8) {
            memcpy(&v, p, 8);
            a = _mm_crc32_u64(a, v);
            b = _mm_crc32_u64(b, v);
            p += 8;
            n -= 8;
        }
        uint32_t a32 = (uint32_t)a, b32 = (uint32_t)b;
        while (n--) {
            a32 = _mm_crc32_u8(a32, *p);
            b32 = _mm_crc32_u8(b32, *p);
            p++;
        }
        *region = ~b32;
        return ~a32;
    }
    static int wrenmq_cpu_has_crc(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("sse4.2");
    }
    #else  /* no instruction: the portable loop only (wrenmq_cpu_has_crc says so) */
    #define wrenmq_crc32c_hw wrenmq_crc32c_sw
    #define wrenmq_crc32c_two_hw wrenmq_crc32c_two_sw
    static int wrenmq_cpu_has_crc(void) { return 0; }
    #endif
    static int wrenmq_use_hw = 0;
    static void wrenmq_shift_tables(void);
    /* Build the tables and choose the instruction if `allow` and the CPU has it; returns
       whether it is used. */
    static int wrenmq_crc_setup(int allow) {
        static int tables = 0;
        if (!tables) {
            wrenmq_crc_tables();
            wrenmq_shift_tables();
            tables = 1;
        }
        wrenmq_use_hw = allow && wrenmq_cpu_has_crc();
        return wrenmq_use_hw;
    }
    static uint32_t wrenmq_crc32c(uint32_t crc, const char *data, size_t n) {
        return wrenmq_use_hw ? wrenmq_crc32c_hw(crc, data, n) : wrenmq_crc32c_sw(crc, data, n);
    }
    static uint32_t wrenmq_crc32c_two(uint32_t crc, uint32_t *region, const char *data, size_t n) {
        return wrenmq_use_hw ? wrenmq_crc32c_two_hw(crc, region, data, n)
                             : wrenmq_crc32c_two_sw(crc, region, data, n);
    }
    /* write_epochs hands writev an array of (address, length) pairs of 64-bit words:
       struct iovec's layout on 64-bit platforms only. */
    #include <sys/uio.h>
    static int wrenmq_iovec_is_two_words(void) {
        return sizeof(struct iovec) == 16 && sizeof(void *) == 8;
    }

    /* CRC-32C of A then B from the CRCs of A and of B and B's length (zlib's
       crc32_combine, for the Castagnoli polynomial): the batch checksum of a batch whose
       payloads were checksummed on their own. GF(2) products modulo the polynomial, in
       the reflected bit order of the CRC (x^0 is the top bit). */
    static uint32_t wrenmq_multmodp(uint32_t a, uint32_t b) {
        uint32_t m = (uint32_t)1 << 31, p = 0;
        for (;;) {
            if (a & m) {
                p ^= b;
                if ((a & (m - 1)) == 0) break;
            }
            m >>= 1;
            b = b & 1 ? (b >> 1) ^ 0x82F63B78u : b >> 1;
        }
        return p;
    }
    static uint32_t wrenmq_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
        uint32_t op = (uint32_t)1 << 31;  /* x^0 */
        uint32_t sq = (uint32_t)1 << 23;  /* x^8: one byte */
        while (len2) {  /* op = x^(8 * len2) */
            if (len2 & 1) op = wrenmq_multmodp(sq, op);
            len2 >>= 1;
            sq = wrenmq_multmodp(sq, sq);
        }
        return wrenmq_multmodp(op, crc1) ^ crc2;
    }

    /* A large payload's checksums (from 1 KiB, with the instruction): the record's, from
       the checksum `crc` of its topic, client id and properties, in three interleaved
       chains, and the running checksum of all payloads (`*region`) combined from it. Two
       chains over the same bytes (wrenmq_crc32c_two_hw) wait for the instruction's
       3-cycle latency at every 8 bytes; three over three blocks keep it busy every
       cycle, and the blocks' chains are joined by multiplying by x^(8 * WRENMQ_BLOCK)
       (byte-sliced tables, four lookups). The region needs the payload shifted by its
       own length, x^(8 * n): one product, its factor cached for the last length (a
       fleet's payloads mostly share a few sizes). crc32c(c, d) = crc32c(0, d) ^ c * x^(8|d|),
       so region' = (region ^ crc) * x^(8n) ^ record. */
    #define WRENMQ_BLOCK 256
    static uint32_t wrenmq_shift_tab[4][256];
    static uint32_t wrenmq_x8n(uint64_t n) {  /* x^(8n) modulo the polynomial */
        uint32_t op = (uint32_t)1 << 31, sq = (uint32_t)1 << 23;
        while (n) {
            if (n & 1) op = wrenmq_multmodp(sq, op);
            n >>= 1;
            sq = wrenmq_multmodp(sq, sq);
        }
        return op;
    }
    static void wrenmq_shift_tables(void) {
        uint32_t op = wrenmq_x8n(WRENMQ_BLOCK);
        for (int k = 0; k < 4; k++)
            for (uint32_t b = 0; b < 256; b++)
                wrenmq_shift_tab[k][b] = wrenmq_multmodp(op, b << (8 * k));
    }
    static inline uint32_t wrenmq_shift_block(uint32_t c) {
        return wrenmq_shift_tab[0][c & 0xff] ^ wrenmq_shift_tab[1][(c >> 8) & 0xff]
               ^ wrenmq_shift_tab[2][(c >> 16) & 0xff] ^ wrenmq_shift_tab[3][c >> 24];
    }
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __attribute__((target("sse4.2")))
    static uint32_t wrenmq_crc32c_hw3(uint32_t crc, const char *data, size_t n) {
        const unsigned char *p = (const unsigned char *)data;
        uint64_t c0 = (uint32_t)~crc, c1, c2, v;
        while (n >= 3 * WRENMQ_BLOCK) {
            const unsigned char *end = p + WRENMQ_BLOCK;
            c1 = c2 = 0;
            do {
                memcpy(&v, p, 8);
                c0 = _mm_crc32_u64(c0, v);
                memcpy(&v, p + WRENMQ_BLOCK, 8);
                c1 = _mm_crc32_u64(c1, v);
                memcpy(&v, p + 2 * WRENMQ_BLOCK, 8);
                c2 = _mm_crc32_u64(c2, v);
                p += 8;
            } while (p < end);
            c0 = wrenmq_shift_block((uint32_t)c0) ^ (uint32_t)c1;
            c0 = wrenmq_shift_block((uint32_t)c0) ^ (uint32_t)c2;
            p += 2 * WRENMQ_BLOCK;
            n -= 3 * WRENMQ_BLOCK;
        }
        /* The rest in one chain, from the register as it stands. */
        return wrenmq_crc32c_hw(~(uint32_t)c0, (const char *)p, n);
    }
    #else
    #define wrenmq_crc32c_hw3 wrenmq_crc32c_sw
    #endif
    static uint32_t wrenmq_crc32c_payload(uint32_t crc, uint32_t *region, const char *data,
                                          size_t n, uint64_t *op_len, uint32_t *op) {
        if (!wrenmq_use_hw || n < 1024) return wrenmq_crc32c_two(crc, region, data, n);
        uint32_t rec = wrenmq_crc32c_hw3(crc, data, n);
        if (*op_len != n) {
            *op = wrenmq_x8n(n);
            *op_len = n;
        }
        *region = wrenmq_multmodp(*op, *region ^ crc) ^ rec;
        return rec;
    }

    /* The writer's own writev (write_records): the whole iovec array, in runs of at
       most IOV_MAX buffers and about WRENMQ_WRITE_BYTES (a single 4 MiB write into the
       page cache costs the writer 2.5x the CPU of four 1 MiB ones), short
       writes finished, EINTR retried; 0 or an errno. `iov` holds (address, length)
       pairs of 64-bit words, struct iovec's layout on the 64-bit platforms where the
       encoder is compiled with the CRC instruction. */
    #include <errno.h>
    #include <limits.h>
    #include <sys/uio.h>
    #ifndef IOV_MAX
    #define IOV_MAX 1024
    #endif
    #define WRENMQ_WRITE_BYTES (1 << 20)
    static int wrenmq_writev_all(int fd, unsigned long long *words, int n) {
        struct iovec *iov = (struct iovec *)words;
        if (sizeof(struct iovec) != 16) return ENOSYS;
        while (n > 0) {
            int k = 0;
            size_t bytes = 0;
            while (k < n && k < IOV_MAX && (k == 0 || bytes < WRENMQ_WRITE_BYTES)) {
                bytes += iov[k].iov_len;
                k++;
            }
            ssize_t w = writev(fd, iov, k);
            if (w < 0) {
                if (errno == EINTR) continue;
                return errno;
            }
            while (n > 0 && (size_t)w >= iov->iov_len) {
                w -= (ssize_t)iov->iov_len;
                iov++;
                n--;
            }
            if (n > 0 && w > 0) {
                iov->iov_base = (char *)iov->iov_base + w;
                iov->iov_len -= (size_t)w;
            }
        }
        return 0;
    }
    /* A batch's length and checksum, after its magic (format.py, which the encoder
       copies the magic from; a little-endian machine, as format.py requires). */
    static void wrenmq_put_length_crc(char *buf, uint32_t length, uint32_t crc) {
        memcpy(buf + 4, &length, 4);
        memcpy(buf + 8, &crc, 4);
    }
    /* One record's fixed fields from an epoch's `fixed` buffer (_epoch.FIXED: 32 bytes,
       little-endian). */
    static void wrenmq_get_fixed(const char *f, long long *ts, long long *start, uint32_t *lr,
                                 uint32_t *lp, uint16_t *lt, uint16_t *lc, uint16_t *pid,
                                 uint8_t *flags) {
        int64_t a, b;
        memcpy(&a, f, 8);
        memcpy(&b, f + 8, 8);
        *ts = a;
        *start = b;
        memcpy(lr, f + 16, 4);
        memcpy(lp, f + 20, 4);
        memcpy(lt, f + 24, 2);
        memcpy(lc, f + 26, 2);
        memcpy(pid, f + 28, 2);
        *flags = (uint8_t)f[30];
    }
    static const char *wrenmq_zeros(void) {
        static const char z[8] = {0};
        return z;
    }
    """
    unsigned int wrenmq_crc32c(unsigned int crc, const char *data, size_t n) nogil
    unsigned int wrenmq_crc32c_two(unsigned int crc, unsigned int *region, const char *data, size_t n) nogil
    unsigned int wrenmq_crc32c_combine(unsigned int crc1, unsigned int crc2, unsigned long long len2) nogil
    unsigned int wrenmq_crc32c_payload(unsigned int crc, unsigned int *region, const char *data, size_t n,
                                       unsigned long long *op_len, unsigned int *op) nogil
    int wrenmq_crc_setup(int allow) nogil
    int wrenmq_iovec_is_two_words() nogil
    int wrenmq_writev_all(int fd, unsigned long long *words, int n) nogil
    const char *wrenmq_zeros() nogil
    void wrenmq_put_length_crc(char *buf, unsigned int length, unsigned int crc) nogil
    void wrenmq_get_fixed(const char *f, long long *ts, long long *start, unsigned int *lr,
                          unsigned int *lp, unsigned short *lt, unsigned short *lc,
                          unsigned short *pid, unsigned char *flags) nogil

from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.string cimport memcpy, memset
