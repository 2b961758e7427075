/*
 * loadgen.c - the MQTT load generator of meshmq's benchmark (bench/run.py builds and drives it).
 *
 * Theory of operation
 * -------------------
 * One thread, one epoll set, every connection non-blocking: publishers, subscribers and idle
 * clients of one scenario all live in this process, so it knows what was sent and can check
 * what arrived. Packets are encoded once (CONNECT, SUBSCRIBE, a PUBLISH template per
 * publisher); sending a message patches the payload's sequence number and timestamp and, at
 * QoS 1, the packet id into a copy of the template, many messages per write().
 *
 * Payload (at least 24 bytes): u32 publisher index, u32 magic, u64 sequence, u64 send time
 * (CLOCK_MONOTONIC ns, taken when the message is written into the output buffer), zero padding.
 * Each subscriber keeps, per publisher it should hear from, the next sequence it expects:
 * a higher one counts the skipped messages as missing, a lower one counts a duplicate. At the
 * end, what each publisher sent minus what each matching subscriber reached is missing too.
 * At QoS 1 any missing message, refused PUBACK or unacknowledged publish is a failure
 * (exit status 3); at QoS 0 losses are reported, not failed.
 *
 * Flow control: a publisher stays at most --lead messages ahead of the slowest healthy
 * subscriber that hears it (a sequence gap counts as settled) and, at QoS 1, has at most
 * --window publishes unacknowledged (capped by a 5.0 CONNACK's Receive Maximum). So the broker
 * is measured at full speed without an ever-growing backlog in socket buffers.
 *
 * Modes:
 *   throughput  publishers write as fast as that flow control allows; after --warmup s a
 *               --duration s window is measured; then publishing stops and the subscribers
 *               drain until each has every publisher's last message (or nothing moved for
 *               --drain s at QoS 1, at most 2 s at QoS 0).
 *   latency     the same, but publishers are paced to --rate messages/s in total and every
 *               delivery inside the window records (receive time - send time).
 *   idle        --conns clients connect (--concurrency at a time) and stay idle until stdin
 *               reaches EOF, so the harness can measure the broker's memory meanwhile.
 *   storm       latency mode's paced stream (--pubs publishers, --subs subscribers) runs
 *               through --warmup s of calm; then --conns idle clients connect (--concurrency
 *               handshakes at a time) while the stream goes on. The measured window is the
 *               storm, from the first connect() to the last CONNACK: the stream's latency in
 *               it (and in the calm warm-up, "calm_*") says whether established connections
 *               were stalled by the newcomers.
 *
 * Connections: plain TCP, or TLS 1.3 with --tls (full handshakes: no session resumption, the
 * server's certificate is not verified); CONNECT carries --username/--password when given.
 *
 * Output, one line each on stdout, flushed: "event connecting" (idle mode, before the first
 * connect), "event ready", "event window-start", "event window-end" (the harness samples the
 * broker's CPU and memory at those moments), then "result {json}". Fatal problems:
 * "error <text>" on stdout and a non-zero exit.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAGIC 0x4d514c47u /* "MQLG" */
#define PAYLOAD_MIN 24
#define RBUF_SIZE (256 * 1024)
#define OUT_CHUNK (64 * 1024) /* bytes of new publishes encoded per refill */
#define MAX_EVENTS 1024

enum mode { MODE_THROUGHPUT, MODE_LATENCY, MODE_IDLE, MODE_STORM };
enum topology { TOPO_FANIN, TOPO_FANOUT, TOPO_PAIRS };
enum role { ROLE_PUB, ROLE_SUB, ROLE_STALLED, ROLE_IDLE };
enum state { ST_NEW, ST_CONNECTING, ST_TLS, ST_WAIT_CONNACK, ST_WAIT_SUBACK, ST_READY, ST_CLOSED };

struct buf {
    unsigned char *data;
    size_t len, off, cap;
};

struct conn {
    int fd;
    int index; /* index within its role */
    enum role role;
    enum state state;
    uint32_t events; /* epoll interest currently registered */
    SSL *ssl;        /* --tls */
    int tls_want;    /* the handshake waits for EPOLLIN or EPOLLOUT */
    struct buf out;
    unsigned char *partial; /* bytes of an incomplete packet from the last read */
    size_t plen, pcap;
    /* publisher */
    unsigned char *tmpl; /* pre-encoded PUBLISH */
    size_t tmpl_len, payload_at, id_at;
    uint64_t generated, acked, refused;
    uint32_t inflight, window;
    uint16_t next_id;
    uint64_t relief;  /* sequences below this count as settled (see lead_allowance) */
    int lead_blocked; /* waiting for its subscribers to catch up */
    /* subscriber */
    uint64_t received, received_valid, dups, gaps, foreign;
    uint64_t *next_seq; /* per publisher */
};

struct options {
    int port;
    enum mode mode;
    enum topology topology;
    int pubs, subs, stalled, conns, concurrency, qos, size, protocol, window, lead;
    double warmup, duration, drain, rate, setup_timeout;
    const char *prefix, *username, *password;
    int tls;
};

static struct options opt = {
    .port = 0, .mode = MODE_THROUGHPUT, .topology = TOPO_FANIN, .pubs = 1, .subs = 1,
    .stalled = 0, .conns = 0, .concurrency = 64, .qos = 0, .size = 64, .protocol = 4,
    .window = 1024, .lead = 1000, .warmup = 1.0, .duration = 5.0, .drain = 10.0, .rate = 10000.0,
    .setup_timeout = 120.0, .prefix = "bench", .username = NULL, .password = NULL, .tls = 0,
};

static struct conn *conns;
static int nconns, npubs, nsubs; /* publishers are conns[0..npubs), then subscribers */
static int nstream;              /* connections opened at set-up (storm: the rest come later) */
static int n_idle_ready;         /* idle clients that got their CONNACK */
static SSL_CTX *ssl_ctx;         /* --tls */
static int epfd;
static unsigned char rbuf[RBUF_SIZE];
static int publishing;
static double t_start;         /* publishing started */
static uint64_t reliefs;       /* times publishers stopped waiting for lost messages */
static uint64_t progress_count; /* PUBLISH and PUBACK packets received, all connections */
static uint64_t unexpected_closes, refused_connacks, refused_subacks;
static int n_ready, n_closed; /* connections that reached ST_READY / ST_CLOSED */
struct samples {
    uint64_t *ns;
    size_t len, cap;
};
static struct samples lat, calm; /* latencies in the window; storm: also in the calm warm-up */
static int recording;          /* inside the measured window */
static int recording_calm;     /* storm: inside the warm-up */
static char first_error[256];

/* ------------------------------------------------------------------ small helpers */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("error ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
    exit(2);
}

static void note_error(const char *fmt, ...) {
    if (first_error[0])
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(first_error, sizeof first_error, fmt, ap);
    va_end(ap);
}

static void *xmalloc(size_t n) {
    void *p = calloc(1, n ? n : 1);
    if (!p)
        die("out of memory");
    return p;
}

static void buf_reserve(struct buf *b, size_t extra) {
    if (b->len + extra <= b->cap)
        return;
    if (b->off) { /* compact first */
        memmove(b->data, b->data + b->off, b->len - b->off);
        b->len -= b->off;
        b->off = 0;
        if (b->len + extra <= b->cap)
            return;
    }
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra)
        cap *= 2;
    b->data = realloc(b->data, cap);
    if (!b->data)
        die("out of memory");
    b->cap = cap;
}

static void buf_put(struct buf *b, const void *data, size_t n) {
    buf_reserve(b, n);
    memcpy(b->data + b->len, data, n);
    b->len += n;
}

static size_t put_varint(unsigned char *p, size_t value) {
    size_t n = 0;
    do {
        unsigned char byte = value % 128;
        value /= 128;
        p[n++] = byte | (value ? 0x80 : 0);
    } while (value);
    return n;
}

static size_t put_str(unsigned char *p, const char *s) {
    size_t n = strlen(s);
    p[0] = (unsigned char)(n >> 8);
    p[1] = (unsigned char)n;
    memcpy(p + 2, s, n);
    return n + 2;
}

/* Frame ``body`` (``n`` bytes) behind a fixed header into ``out``; returns the frame length. */
static size_t frame(unsigned char *out, unsigned char first, const unsigned char *body, size_t n) {
    out[0] = first;
    size_t h = 1 + put_varint(out + 1, n);
    memcpy(out + h, body, n);
    return h + n;
}

/* ------------------------------------------------------------------ topology */

static void topic_of_pub(int i, char *out, size_t cap) {
    switch (opt.topology) {
    case TOPO_FANIN: snprintf(out, cap, "%s/in/%d", opt.prefix, i); break;
    case TOPO_FANOUT: snprintf(out, cap, "%s/out", opt.prefix); break;
    case TOPO_PAIRS: snprintf(out, cap, "%s/pair/%d", opt.prefix, i); break;
    }
}

static void filter_of_sub(int i, char *out, size_t cap) {
    switch (opt.topology) {
    case TOPO_FANIN: snprintf(out, cap, "%s/in/#", opt.prefix); break;
    case TOPO_FANOUT: snprintf(out, cap, "%s/out", opt.prefix); break;
    case TOPO_PAIRS: snprintf(out, cap, "%s/pair/%d", opt.prefix, i); break;
    }
}

static int sub_hears(int sub, int pub) {
    return opt.topology != TOPO_PAIRS || sub == pub;
}

/* ------------------------------------------------------------------ packets */

static void encode_connect(struct conn *c, struct buf *out) {
    unsigned char body[640], pkt[672];
    char client_id[64];
    static const char *names[] = {"p", "s", "x", "i"};
    snprintf(client_id, sizeof client_id, "lg%d-%s%d", (int)getpid(), names[c->role], c->index);
    size_t n = put_str(body, "MQTT");
    body[n++] = (unsigned char)opt.protocol;
    /* clean session / clean start, and the user name and password flags when given */
    body[n++] = 0x02 | (opt.username ? 0x80 : 0) | (opt.password ? 0x40 : 0);
    body[n++] = 0x02; /* keep alive 600 s: idle clients must not need PINGREQ during a run */
    body[n++] = 0x58;
    if (opt.protocol == 5)
        body[n++] = 0; /* no properties: Receive Maximum defaults to 65535 */
    n += put_str(body + n, client_id);
    if (opt.username)
        n += put_str(body + n, opt.username);
    if (opt.password)
        n += put_str(body + n, opt.password);
    buf_put(out, pkt, frame(pkt, 0x10, body, n));
}

static void encode_subscribe(struct conn *c, struct buf *out) {
    unsigned char body[160], pkt[192];
    char filter[128];
    filter_of_sub(c->index, filter, sizeof filter);
    size_t n = 0;
    body[n++] = 0;
    body[n++] = 1; /* packet id 1 */
    if (opt.protocol == 5)
        body[n++] = 0;
    n += put_str(body + n, filter);
    body[n++] = (unsigned char)opt.qos;
    buf_put(out, pkt, frame(pkt, 0x82, body, n));
}

static void build_publish_template(struct conn *c) {
    char topic[128];
    topic_of_pub(c->index, topic, sizeof topic);
    size_t body_len = 2 + strlen(topic) + (opt.qos ? 2 : 0) + (opt.protocol == 5 ? 1 : 0)
                      + (size_t)opt.size;
    unsigned char *body = xmalloc(body_len);
    size_t n = put_str(body, topic);
    c->id_at = n;
    if (opt.qos)
        n += 2;
    if (opt.protocol == 5)
        body[n++] = 0;
    size_t payload_at = n;
    uint32_t index = (uint32_t)c->index, magic = MAGIC;
    memcpy(body + n, &index, 4);
    memcpy(body + n + 4, &magic, 4);
    c->tmpl = xmalloc(body_len + 5);
    c->tmpl_len = frame(c->tmpl, (unsigned char)(0x30 | (opt.qos << 1)), body, body_len);
    size_t header = c->tmpl_len - body_len;
    c->id_at += header;
    c->payload_at = payload_at + header;
    free(body);
}

/* ------------------------------------------------------------------ socket or TLS I/O */

/* read()/write() on the socket, or SSL_read()/SSL_write() with --tls: -1 with errno EAGAIN
 * when the call must wait, 0 at the end of the stream, -1 with another errno on failure. */
static ssize_t io_read(struct conn *c, void *data, size_t n) {
    if (c->ssl == NULL)
        return read(c->fd, data, n);
    int got = SSL_read(c->ssl, data, n > INT32_MAX ? INT32_MAX : (int)n);
    if (got > 0)
        return got;
    int err = SSL_get_error(c->ssl, got);
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
        errno = EAGAIN;
        return -1;
    }
    if (err == SSL_ERROR_ZERO_RETURN)
        return 0;
    errno = EIO;
    return -1;
}

static ssize_t io_write(struct conn *c, const void *data, size_t n) {
    if (c->ssl == NULL)
        return write(c->fd, data, n);
    int put = SSL_write(c->ssl, data, n > INT32_MAX ? INT32_MAX : (int)n);
    if (put > 0)
        return put;
    int err = SSL_get_error(c->ssl, put);
    errno = err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE ? EAGAIN : EIO;
    return -1;
}

static void tls_init(void) {
    ssl_ctx = SSL_CTX_new(TLS_client_method());
    if (ssl_ctx == NULL)
        die("SSL_CTX_new failed");
    SSL_CTX_set_min_proto_version(ssl_ctx, TLS1_3_VERSION);
    SSL_CTX_set_verify(ssl_ctx, SSL_VERIFY_NONE, NULL); /* a benchmark's self-signed cert */
    SSL_CTX_set_session_cache_mode(ssl_ctx, SSL_SESS_CACHE_OFF); /* every handshake is full */
    SSL_CTX_set_mode(ssl_ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
}

/* ------------------------------------------------------------------ epoll plumbing */

static void set_interest(struct conn *c, uint32_t events) {
    if (c->state == ST_CLOSED || c->events == events)
        return;
    struct epoll_event ev = {.events = events, .data.ptr = c};
    int op = c->events == 0 ? EPOLL_CTL_ADD : (events == 0 ? EPOLL_CTL_DEL : EPOLL_CTL_MOD);
    if (epoll_ctl(epfd, op, c->fd, &ev) < 0)
        die("epoll_ctl: %s", strerror(errno));
    c->events = events;
}

static int paced(void) { return opt.mode == MODE_LATENCY || opt.mode == MODE_STORM; }

static int window_open(const struct conn *c) { return opt.qos == 0 || c->inflight < c->window; }

static void update_interest(struct conn *c) {
    if (c->state == ST_CLOSED)
        return;
    if (c->role == ROLE_STALLED && c->state == ST_READY) {
        set_interest(c, 0); /* never read again: the broker's buffers for it fill up */
        return;
    }
    if (c->state == ST_TLS) {
        set_interest(c, c->tls_want);
        return;
    }
    uint32_t ev = EPOLLIN;
    int wants = c->out.len > c->out.off || c->state == ST_CONNECTING;
    if (c->role == ROLE_PUB && c->state == ST_READY && publishing && !paced() && window_open(c)
        && !c->lead_blocked)
        wants = 1;
    if (wants)
        ev |= EPOLLOUT;
    set_interest(c, ev);
}

static void close_conn(struct conn *c, int expected) {
    if (c->state == ST_CLOSED)
        return;
    if (!expected) {
        unexpected_closes++;
        note_error("connection %c%d closed by the broker", "psxi"[c->role], c->index);
    }
    set_interest(c, 0);
    if (c->ssl != NULL) {
        SSL_free(c->ssl);
        c->ssl = NULL;
    }
    close(c->fd);
    if (c->state == ST_READY) {
        n_ready--;
        if (c->role == ROLE_IDLE)
            n_idle_ready--;
    }
    n_closed++;
    c->state = ST_CLOSED;
}

static int open_socket(struct conn *c) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        die("socket: %s (raise RLIMIT_NOFILE?)", strerror(errno));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (c->role == ROLE_STALLED) { /* a small receive buffer so the stall shows quickly */
        int small = 4096;
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    }
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)opt.port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    c->fd = fd;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0 && errno != EINPROGRESS) {
        note_error("connect: %s", strerror(errno));
        close(fd);
        return -1;
    }
    c->state = ST_CONNECTING;
    encode_connect(c, &c->out);
    update_interest(c);
    return 0;
}

/* ------------------------------------------------------------------ writing */

/* Encode as many new publishes as the window, the pacing and one chunk allow. */
static void refill(struct conn *c, uint64_t allowed) {
    size_t count = OUT_CHUNK / c->tmpl_len;
    if (count == 0)
        count = 1;
    if (opt.qos && c->window - c->inflight < count)
        count = c->window - c->inflight;
    if (allowed < count)
        count = (size_t)allowed;
    if (count == 0)
        return;
    buf_reserve(&c->out, count * c->tmpl_len);
    uint64_t t = now_ns();
    unsigned char *p = c->out.data + c->out.len;
    for (size_t i = 0; i < count; i++, p += c->tmpl_len) {
        memcpy(p, c->tmpl, c->tmpl_len);
        uint64_t seq = c->generated++;
        memcpy(p + c->payload_at + 8, &seq, 8);
        memcpy(p + c->payload_at + 16, &t, 8);
        if (opt.qos) {
            if (++c->next_id == 0)
                c->next_id = 1;
            p[c->id_at] = (unsigned char)(c->next_id >> 8);
            p[c->id_at + 1] = (unsigned char)c->next_id;
            c->inflight++;
        }
    }
    c->out.len += count * c->tmpl_len;
}

static uint64_t pace_allowance(struct conn *c) {
    if (!paced())
        return UINT64_MAX;
    double per_pub = opt.rate / npubs;
    double due = (now_s() - t_start) * per_pub + 1.0;
    return due > (double)c->generated ? (uint64_t)due - c->generated : 0;
}

/* When the earliest publisher is due to send its next paced message (one whose window or
 * lead is full waits for an acknowledgement or a delivery instead: it wakes us by itself). */
static double next_due(void) {
    double per_pub = opt.rate / npubs, due = 1e300;
    for (int i = 0; i < npubs; i++) {
        const struct conn *c = &conns[i];
        if (c->state == ST_READY && window_open(c) && !c->lead_blocked)
            due = fmin(due, t_start + (double)c->generated / per_pub);
    }
    return due;
}

/* How many more messages publisher ``c`` may send: it stays at most --lead messages ahead
 * of the slowest (non-stalled) subscriber that hears it, so no broker is measured with an
 * ever-growing backlog in socket buffers. A sequence gap a subscriber saw counts as settled
 * (the message was lost, not late), and so does everything before ``relief``. */
static uint64_t lead_allowance(struct conn *c) {
    if (opt.lead <= 0)
        return UINT64_MAX;
    uint64_t settled = UINT64_MAX;
    int first = npubs, last = npubs + opt.subs; /* the healthy subscribers */
    if (opt.topology == TOPO_PAIRS) {            /* only its partner hears it */
        first = npubs + c->index;
        last = c->index < opt.subs ? first + 1 : first;
    }
    for (int i = first; i < last; i++) {
        const struct conn *s = &conns[i];
        if (s->state != ST_CLOSED && s->next_seq[c->index] < settled)
            settled = s->next_seq[c->index];
    }
    if (settled == UINT64_MAX)
        return UINT64_MAX;
    if (c->relief > settled)
        settled = c->relief;
    uint64_t ahead = c->generated - settled;
    return ahead >= (uint64_t)opt.lead ? 0 : (uint64_t)opt.lead - ahead;
}

static void flush_out(struct conn *c) {
    for (;;) {
        struct buf *b = &c->out;
        if (b->off == b->len) {
            b->off = b->len = 0;
            if (c->role != ROLE_PUB || c->state != ST_READY || !publishing)
                break;
            uint64_t allowed = pace_allowance(c), lead = lead_allowance(c);
            c->lead_blocked = lead == 0;
            refill(c, allowed < lead ? allowed : lead);
            if (b->len == 0)
                break;
        }
        ssize_t n = io_write(c, b->data + b->off, b->len - b->off);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                break;
            close_conn(c, 0);
            return;
        }
        b->off += (size_t)n;
    }
    update_interest(c);
}

/* ------------------------------------------------------------------ reading */

static void on_publish(struct conn *c, unsigned char flags, const unsigned char *p, size_t n) {
    int qos = (flags >> 1) & 3;
    if (n < 2)
        return;
    size_t at = 2 + ((size_t)p[0] << 8 | p[1]);
    uint16_t id = 0;
    if (qos) {
        if (at + 2 > n)
            return;
        id = (uint16_t)(p[at] << 8 | p[at + 1]);
        at += 2;
    }
    if (opt.protocol == 5) { /* skip properties (e.g. meshmq's partition/offset) */
        size_t plen = 0, mult = 1;
        while (at < n) {
            unsigned char b = p[at++];
            plen += (b & 0x7f) * mult;
            mult *= 128;
            if (!(b & 0x80))
                break;
        }
        at += plen;
    }
    if (qos) {
        unsigned char ack[4] = {0x40, 2, (unsigned char)(id >> 8), (unsigned char)id};
        buf_put(&c->out, ack, 4);
    }
    c->received++;
    progress_count++;
    uint32_t index, magic;
    uint64_t seq, sent;
    if (at + PAYLOAD_MIN > n) {
        c->foreign++;
        return;
    }
    memcpy(&index, p + at, 4);
    memcpy(&magic, p + at + 4, 4);
    memcpy(&seq, p + at + 8, 8);
    memcpy(&sent, p + at + 16, 8);
    if (magic != MAGIC || index >= (uint32_t)npubs || !sub_hears(c->index, (int)index)) {
        c->foreign++;
        return;
    }
    uint64_t *next = &c->next_seq[index];
    if (seq < *next) {
        c->dups++;
        return;
    }
    if (seq > *next)
        c->gaps += seq - *next;
    *next = seq + 1;
    c->received_valid++;
    if (paced() && (recording || recording_calm)) {
        struct samples *s = recording ? &lat : &calm;
        if (s->len == s->cap) {
            s->cap = s->cap ? s->cap * 2 : 65536;
            s->ns = realloc(s->ns, s->cap * sizeof *s->ns);
            if (!s->ns)
                die("out of memory");
        }
        s->ns[s->len++] = now_ns() - sent;
    }
}

static void on_packet(struct conn *c, unsigned char first, const unsigned char *p, size_t n) {
    switch (first >> 4) {
    case 2: /* CONNACK */
        if (n < 2 || p[1] != 0) {
            refused_connacks++;
            note_error("CONNACK refused: code 0x%02x", n >= 2 ? p[1] : 0xff);
            close_conn(c, 1);
            return;
        }
        if (opt.protocol == 5 && n > 2) { /* Receive Maximum (0x21) caps the window */
            size_t at = 2, plen = 0, mult = 1;
            while (at < n) {
                unsigned char b = p[at++];
                plen += (b & 0x7f) * mult;
                mult *= 128;
                if (!(b & 0x80))
                    break;
            }
            size_t end = at + plen < n ? at + plen : n;
            while (at < end) { /* walk the properties we may meet in a CONNACK */
                unsigned char id = p[at++];
                if (id == 0x21 && at + 2 <= end) {
                    uint32_t rm = (uint32_t)(p[at] << 8 | p[at + 1]);
                    if (rm < c->window)
                        c->window = rm;
                    at += 2;
                } else if (id == 0x24 || id == 0x25 || id == 0x28 || id == 0x29 || id == 0x2A) {
                    at += 1;
                } else if (id == 0x13 || id == 0x22 || id == 0x21) {
                    at += 2;
                } else if (id == 0x11 || id == 0x27) {
                    at += 4;
                } else if (id == 0x12 || id == 0x1A || id == 0x1C || id == 0x1F || id == 0x15
                           || id == 0x16) {
                    at += 2 + (at + 1 < end ? ((size_t)p[at] << 8 | p[at + 1]) : 0);
                } else if (id == 0x26) {
                    size_t k = at + 1 < end ? ((size_t)p[at] << 8 | p[at + 1]) : 0;
                    at += 2 + k;
                    size_t v = at + 1 < end ? ((size_t)p[at] << 8 | p[at + 1]) : 0;
                    at += 2 + v;
                } else {
                    break; /* unknown: stop looking */
                }
            }
        }
        if (c->role == ROLE_SUB || c->role == ROLE_STALLED) {
            encode_subscribe(c, &c->out);
            c->state = ST_WAIT_SUBACK;
        } else {
            c->state = ST_READY;
            n_ready++;
            if (c->role == ROLE_IDLE)
                n_idle_ready++;
        }
        return;
    case 9: { /* SUBACK */
        size_t at = 2;
        if (opt.protocol == 5 && n > 2)
            at += 1 + p[2]; /* property length fits one byte: we expect none */
        if (at >= n || p[at] >= 0x80) {
            refused_subacks++;
            note_error("SUBACK refused: code 0x%02x", at < n ? p[at] : 0xff);
        }
        if (c->state == ST_WAIT_SUBACK) {
            c->state = ST_READY;
            n_ready++;
        }
        return;
    }
    case 3:
        on_publish(c, first & 0x0f, p, n);
        return;
    case 4: /* PUBACK */
        if (c->inflight)
            c->inflight--;
        c->acked++;
        progress_count++;
        if (opt.protocol == 5 && n >= 3 && p[2] >= 0x80) {
            c->refused++;
            note_error("PUBACK refused: reason 0x%02x", p[2]);
        }
        return;
    case 14: /* DISCONNECT from the broker */
        note_error("DISCONNECT from the broker: reason 0x%02x", n >= 1 ? p[0] : 0);
        close_conn(c, 0);
        return;
    default:
        return;
    }
}

static void tls_handshake(struct conn *c);

static void on_readable(struct conn *c) {
    if (c->state == ST_TLS) {
        tls_handshake(c);
        if (c->state == ST_TLS || c->state == ST_CLOSED)
            return;
    }
    size_t have = c->plen;
    if (have)
        memcpy(rbuf, c->partial, have);
    ssize_t n = io_read(c, rbuf + have, RBUF_SIZE - have);
    if (n < 0) {
        if (errno == EAGAIN || errno == EINTR)
            return;
        close_conn(c, 0);
        return;
    }
    if (n == 0) {
        close_conn(c, 0);
        return;
    }
    have += (size_t)n;
    size_t off = 0;
    while (off + 2 <= have && c->state != ST_CLOSED) {
        size_t rl = 0, mult = 1, h = 1;
        int complete = 0;
        while (off + h < have && h <= 4) {
            unsigned char b = rbuf[off + h++];
            rl += (b & 0x7f) * mult;
            mult *= 128;
            if (!(b & 0x80)) {
                complete = 1;
                break;
            }
        }
        if (!complete || off + h + rl > have)
            break;
        on_packet(c, rbuf[off], rbuf + off + h, rl);
        off += h + rl;
    }
    size_t left = have - off;
    if (left > c->pcap) {
        c->pcap = left < 256 ? 256 : left;
        c->partial = realloc(c->partial, c->pcap);
        if (!c->partial)
            die("out of memory");
    }
    memmove(c->partial, rbuf + off, left);
    c->plen = left;
    if (c->state != ST_CLOSED)
        flush_out(c); /* PUBACKs, SUBSCRIBE, or publishes the window now allows */
    if (c->state != ST_CLOSED && c->ssl != NULL && SSL_pending(c->ssl) > 0)
        on_readable(c); /* decrypted bytes epoll cannot tell us about */
}

/* Advance the TLS handshake; once done, the CONNECT goes out. */
static void tls_handshake(struct conn *c) {
    ERR_clear_error();
    int rc = SSL_do_handshake(c->ssl);
    if (rc == 1) {
        c->state = ST_WAIT_CONNACK;
        flush_out(c);
        return;
    }
    int err = SSL_get_error(c->ssl, rc);
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
        c->tls_want = err == SSL_ERROR_WANT_READ ? EPOLLIN : EPOLLOUT;
        update_interest(c);
        return;
    }
    char text[160];
    ERR_error_string_n(ERR_get_error(), text, sizeof text);
    note_error("TLS handshake failed: %s", text);
    close_conn(c, 0);
}

static void on_writable(struct conn *c) {
    if (c->state == ST_CONNECTING) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) {
            note_error("connect: %s", strerror(err));
            close_conn(c, 0);
            return;
        }
        if (opt.tls) {
            c->ssl = SSL_new(ssl_ctx);
            if (c->ssl == NULL || SSL_set_fd(c->ssl, c->fd) != 1)
                die("SSL_new failed");
            SSL_set_connect_state(c->ssl);
            c->state = ST_TLS;
        } else {
            c->state = ST_WAIT_CONNACK;
        }
    }
    if (c->state == ST_TLS) {
        tls_handshake(c);
        return;
    }
    flush_out(c);
}

/* ------------------------------------------------------------------ the loop */

static void poll_once(double timeout_s) {
    struct epoll_event evs[MAX_EVENTS];
    if (timeout_s < 0)
        timeout_s = 0;
    struct timespec ts = {.tv_sec = (time_t)timeout_s};
    ts.tv_nsec = (long)((timeout_s - (double)ts.tv_sec) * 1e9);
    int n = epoll_pwait2(epfd, evs, MAX_EVENTS, &ts, NULL);
    if (n < 0) {
        if (errno == EINTR)
            return;
        die("epoll_wait: %s", strerror(errno));
    }
    for (int i = 0; i < n; i++) {
        struct conn *c = evs[i].data.ptr;
        if (c == NULL)
            continue; /* stdin: looked at by the idle mode */
        if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR))
            on_readable(c);
        if (c->state != ST_CLOSED && (evs[i].events & EPOLLOUT))
            on_writable(c);
    }
}

/* Open the first ``count`` connections, ``concurrency`` handshakes at a time; return the
 * seconds taken. */
static double connect_all(int count) {
    double t0 = now_s(), deadline = t0 + opt.setup_timeout;
    int started = 0;
    for (;;) {
        int ready = n_ready, failed = n_closed, pending = started - ready - failed;
        if (failed)
            die("%d of %d connections failed during set-up: %s", failed, count, first_error);
        while (started < count && pending < opt.concurrency) {
            if (open_socket(&conns[started]) < 0)
                die("cannot open connection %d: %s", started, first_error);
            started++;
            pending++;
        }
        if (ready == count)
            return now_s() - t0;
        if (now_s() > deadline)
            die("set-up timed out: %d of %d connections ready", ready, count);
        poll_once(0.05);
    }
}

/* Storm: open more idle clients (conns[nstream..]) while fewer than ``concurrency`` are
 * between connect() and CONNACK; return how many have been started. */
static int storm_step(int started) {
    int storm = nconns - nstream;
    int pending = started - n_idle_ready - n_closed;
    while (started < storm && pending < opt.concurrency) {
        if (open_socket(&conns[nstream + started]) < 0)
            die("cannot open storm connection %d: %s", started, first_error);
        started++;
        pending++;
    }
    return started;
}

struct snapshot {
    double t;
    uint64_t generated, delivered;
    double cpu;
};

static double cpu_seconds(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec
           + ru.ru_stime.tv_usec / 1e6;
}

static struct snapshot take_snapshot(void) {
    struct snapshot s = {.t = now_s(), .cpu = cpu_seconds()};
    for (int i = 0; i < npubs; i++)
        s.generated += conns[i].generated;
    for (int i = npubs; i < nstream; i++)
        if (conns[i].role == ROLE_SUB)
            s.delivered += conns[i].received;
    return s;
}

static void event(const char *name) {
    printf("event %s\n", name);
    fflush(stdout);
}

static uint64_t expected_for(const struct conn *sub) {
    uint64_t total = 0;
    for (int p = 0; p < npubs; p++)
        if (sub_hears(sub->index, p))
            total += conns[p].generated;
    return total;
}

static int drained(void) {
    for (int i = 0; i < npubs; i++) {
        const struct conn *c = &conns[i];
        if (c->state == ST_CLOSED)
            continue;
        if (c->out.len > c->out.off || (opt.qos && c->acked < c->generated))
            return 0;
    }
    for (int i = npubs; i < npubs + opt.subs; i++) { /* healthy subscribers heard the last */
        const struct conn *c = &conns[i];
        if (c->state == ST_CLOSED)
            continue;
        int p0 = opt.topology == TOPO_PAIRS ? c->index : 0;
        int p1 = opt.topology == TOPO_PAIRS ? c->index + 1 : npubs;
        for (int p = p0; p < p1; p++)
            if (c->next_seq[p] < conns[p].generated)
                return 0;
    }
    return 1;
}

static uint64_t progress(void) { return progress_count; }

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static double percentile_us(const struct samples *s, double q) {
    if (s->len == 0)
        return -1;
    size_t k = (size_t)(q * (double)(s->len - 1) + 0.5);
    return (double)s->ns[k] / 1000.0;
}

/* Did the broker close this connection (we stopped reading it, so only TCP state tells)? */
static int peer_closed(const struct conn *c) {
    struct tcp_info info;
    socklen_t len = sizeof info;
    if (c->state == ST_CLOSED)
        return 1;
    if (getsockopt(c->fd, IPPROTO_TCP, TCP_INFO, &info, &len) < 0)
        return 0;
    return info.tcpi_state != TCP_ESTABLISHED;
}

static int run_traffic(void) {
    double setup = connect_all(nstream);
    int storm = opt.mode == MODE_STORM, storm_started = 0;
    double storm_t0 = 0, storm_s = 0;
    event("ready");
    publishing = 1;
    recording_calm = storm;
    t_start = now_s();
    double t_window = t_start + opt.warmup, t_end = t_window + opt.duration;
    for (int i = 0; i < npubs; i++)
        flush_out(&conns[i]);
    struct snapshot s0 = {0}, s1 = {0};
    int phase = 0; /* 0 warm-up, 1 window, 2 drain */
    double last_progress_t = t_start;
    uint64_t last_progress = 0;
    double drain_started = 0;
    for (;;) {
        double t = now_s();
        if (phase == 0 && t >= t_window) {
            s0 = take_snapshot();
            recording_calm = 0;
            recording = 1;
            phase = 1;
            event("window-start");
            storm_t0 = now_s();
        }
        if (phase == 1 && storm) { /* the window is the storm: it ends with the last CONNACK */
            storm_started = storm_step(storm_started);
            if (n_closed)
                die("%d storm connections failed: %s", n_closed, first_error);
            if (n_idle_ready == nconns - nstream) {
                storm_s = now_s() - storm_t0;
                t_end = t;
            } else if (t - storm_t0 > opt.setup_timeout) {
                die("storm timed out: %d of %d connections ready", n_idle_ready,
                    nconns - nstream);
            } else {
                t_end = t + 1.0;
            }
        }
        if (phase == 1 && t >= t_end) {
            s1 = take_snapshot();
            recording = 0;
            publishing = 0;
            phase = 2;
            event("window-end");
            drain_started = last_progress_t = now_s();
            last_progress = progress();
            for (int i = 0; i < npubs; i++)
                update_interest(&conns[i]);
        }
        if (phase == 2) {
            if (drained())
                break;
            uint64_t p = progress();
            if (p != last_progress) {
                last_progress = p;
                last_progress_t = t;
            } else if (t - last_progress_t > (opt.qos ? opt.drain : fmin(opt.drain, 2.0))) {
                break; /* nothing moved for a while: count what is missing */
            }
        }
        if (publishing) {
            uint64_t p = progress();
            if (p != last_progress) {
                last_progress = p;
                last_progress_t = t;
            } else if (t - last_progress_t > 1.0) { /* lost tail messages: stop waiting */
                for (int i = 0; i < npubs; i++)
                    conns[i].relief = conns[i].generated;
                reliefs++;
                last_progress_t = t;
            }
            for (int i = 0; i < npubs; i++)
                if (conns[i].state == ST_READY && (paced() || conns[i].lead_blocked))
                    flush_out(&conns[i]);
        }
        double timeout = storm && phase == 1 ? 0.005 : 0.02;
        if (phase < 2) /* wake up for the window's edges */
            timeout = fmin(timeout, (phase == 0 ? t_window : t_end) - t);
        if (paced() && publishing) /* and when the next message is due */
            timeout = fmin(timeout, next_due() - now_s());
        poll_once(timeout);
    }
    double drain_s = now_s() - drain_started;

    /* Validation. */
    uint64_t generated = 0, acked = 0, refused = 0, unacked = 0;
    for (int i = 0; i < npubs; i++) {
        struct conn *c = &conns[i];
        generated += c->generated;
        acked += c->acked;
        refused += c->refused;
        if (opt.qos && c->acked < c->generated)
            unacked += c->generated - c->acked;
    }
    uint64_t expected = 0, received = 0, valid = 0, dups = 0, foreign = 0, missing = 0;
    uint64_t stalled_received = 0, stalled_dropped = 0;
    for (int i = npubs; i < nstream; i++) {
        struct conn *c = &conns[i];
        if (c->role == ROLE_STALLED) {
            stalled_received += c->received;
            stalled_dropped += peer_closed(c);
            continue;
        }
        expected += expected_for(c);
        received += c->received;
        valid += c->received_valid;
        dups += c->dups;
        foreign += c->foreign;
        for (int p = 0; p < npubs; p++)
            if (sub_hears(c->index, p) && conns[p].generated > c->next_seq[p])
                missing += conns[p].generated - c->next_seq[p];
        missing += c->gaps;
    }
    double window = s1.t - s0.t;
    double lg_cpu = s1.cpu - s0.cpu;
    int ok = unexpected_closes == 0 && refused_subacks == 0 && foreign == 0;
    if (opt.qos)
        ok = ok && missing == 0 && refused == 0 && unacked == 0;
    if (paced()) {
        qsort(lat.ns, lat.len, sizeof *lat.ns, cmp_u64);
        qsort(calm.ns, calm.len, sizeof *calm.ns, cmp_u64);
    }
    if (storm)
        ok = ok && refused_connacks == 0 && n_idle_ready == nconns - nstream;

    printf("result {\"ok\": %s, \"setup_s\": %.3f, \"window_s\": %.4f, \"drain_s\": %.3f, "
           "\"published\": %llu, \"published_window\": %llu, \"delivered_window\": %llu, "
           "\"publish_rate\": %.1f, \"delivery_rate\": %.1f, \"expected\": %llu, "
           "\"received\": %llu, \"valid\": %llu, \"missing\": %llu, \"duplicates\": %llu, "
           "\"foreign\": %llu, \"acked\": %llu, \"refused\": %llu, \"unacked\": %llu, "
           "\"stalled_received\": %llu, \"stalled_disconnected\": %llu, \"unexpected_closes\": %llu, \"lead_reliefs\": %llu, "
           "\"loadgen_cpu_s\": %.3f, \"loadgen_cpu_pct\": %.1f, "
           "\"latency_samples\": %zu, \"p50_us\": %.1f, \"p99_us\": %.1f, \"p999_us\": %.1f, "
           "\"max_us\": %.1f, \"calm_samples\": %zu, \"calm_p50_us\": %.1f, "
           "\"calm_p99_us\": %.1f, \"calm_max_us\": %.1f, \"storm_conns\": %d, "
           "\"storm_ready\": %d, \"storm_s\": %.3f, \"storm_rate\": %.1f, "
           "\"error\": \"%s\"}\n",
           ok ? "true" : "false", setup, window, drain_s, (unsigned long long)generated,
           (unsigned long long)(s1.generated - s0.generated),
           (unsigned long long)(s1.delivered - s0.delivered),
           window > 0 ? (double)(s1.generated - s0.generated) / window : 0.0,
           window > 0 ? (double)(s1.delivered - s0.delivered) / window : 0.0,
           (unsigned long long)expected, (unsigned long long)received,
           (unsigned long long)valid, (unsigned long long)missing, (unsigned long long)dups,
           (unsigned long long)foreign, (unsigned long long)acked, (unsigned long long)refused,
           (unsigned long long)unacked, (unsigned long long)stalled_received,
           (unsigned long long)stalled_dropped,
           (unsigned long long)unexpected_closes, (unsigned long long)reliefs, lg_cpu,
           window > 0 ? 100.0 * lg_cpu / window : 0.0, lat.len, percentile_us(&lat, 0.50),
           percentile_us(&lat, 0.99), percentile_us(&lat, 0.999), percentile_us(&lat, 1.0),
           calm.len, percentile_us(&calm, 0.50), percentile_us(&calm, 0.99),
           percentile_us(&calm, 1.0), nconns - nstream, n_idle_ready, storm_s,
           storm_s > 0 ? (nconns - nstream) / storm_s : 0.0, first_error);
    fflush(stdout);
    return ok ? 0 : 3;
}

static int run_idle(void) {
    event("connecting");
    double cpu0 = cpu_seconds();
    double setup = connect_all(nconns);
    double cpu = cpu_seconds() - cpu0;
    printf("event ready {\"connections\": %d, \"connect_s\": %.3f, \"connect_rate\": %.1f, "
           "\"loadgen_cpu_pct\": %.1f}\n",
           nconns, setup, setup > 0 ? nconns / setup : 0.0, setup > 0 ? 100.0 * cpu / setup : 0);
    fflush(stdout);
    /* Hold the connections until the harness closes our stdin. */
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(epfd, EPOLL_CTL_ADD, 0, &ev);
    for (;;) {
        struct epoll_event evs[MAX_EVENTS];
        int n = epoll_wait(epfd, evs, MAX_EVENTS, 1000);
        int done = 0;
        for (int i = 0; i < n; i++) {
            struct conn *c = evs[i].data.ptr;
            if (c == NULL) {
                char tmp[256];
                if (read(0, tmp, sizeof tmp) <= 0)
                    done = 1;
            } else if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
                on_readable(c);
            }
        }
        if (done)
            break;
    }
    int alive = 0;
    for (int i = 0; i < nconns; i++)
        alive += conns[i].state == ST_READY;
    int ok = alive == nconns && unexpected_closes == 0;
    printf("result {\"ok\": %s, \"connections\": %d, \"alive\": %d, \"connect_s\": %.3f, "
           "\"connect_rate\": %.1f, \"unexpected_closes\": %llu, \"error\": \"%s\"}\n",
           ok ? "true" : "false", nconns, alive, setup, setup > 0 ? nconns / setup : 0.0,
           (unsigned long long)unexpected_closes, first_error);
    fflush(stdout);
    return ok ? 0 : 3;
}

/* ------------------------------------------------------------------ set-up */

static void usage(void) {
    fprintf(stderr,
            "usage: loadgen --port N [--mode throughput|latency|idle|storm]\n"
            "  [--topology fanin|fanout|pairs] [--pubs N] [--subs N] [--stalled N]\n"
            "  [--qos 0|1] [--size BYTES] [--protocol 4|5] [--window N] [--rate MSG/S]\n"
            "  [--warmup S] [--duration S] [--drain S] [--conns N] [--concurrency N]\n"
            "  [--lead N] [--prefix TOPIC] [--username U] [--password P] [--tls]\n");
    exit(2);
}

static void parse_args(int argc, char **argv) {
    if (argc < 2)
        usage();
    static struct option longopts[] = {
        {"port", 1, 0, 'P'}, {"mode", 1, 0, 'm'}, {"topology", 1, 0, 't'},
        {"pubs", 1, 0, 'p'}, {"subs", 1, 0, 's'}, {"stalled", 1, 0, 'x'},
        {"qos", 1, 0, 'q'}, {"size", 1, 0, 'z'}, {"protocol", 1, 0, 'V'},
        {"window", 1, 0, 'w'}, {"rate", 1, 0, 'r'}, {"warmup", 1, 0, 'W'},
        {"duration", 1, 0, 'd'}, {"drain", 1, 0, 'D'}, {"conns", 1, 0, 'c'},
        {"concurrency", 1, 0, 'C'}, {"lead", 1, 0, 'L'}, {"prefix", 1, 0, 'f'}, {"setup-timeout", 1, 0, 'T'},
        {"username", 1, 0, 'u'}, {"password", 1, 0, 'k'}, {"tls", 0, 0, 'S'},
        {0, 0, 0, 0},
    };
    int ch;
    while ((ch = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        switch (ch) {
        case 'P': opt.port = atoi(optarg); break;
        case 'm':
            if (!strcmp(optarg, "throughput")) opt.mode = MODE_THROUGHPUT;
            else if (!strcmp(optarg, "latency")) opt.mode = MODE_LATENCY;
            else if (!strcmp(optarg, "idle")) opt.mode = MODE_IDLE;
            else if (!strcmp(optarg, "storm")) opt.mode = MODE_STORM;
            else usage();
            break;
        case 't':
            if (!strcmp(optarg, "fanin")) opt.topology = TOPO_FANIN;
            else if (!strcmp(optarg, "fanout")) opt.topology = TOPO_FANOUT;
            else if (!strcmp(optarg, "pairs")) opt.topology = TOPO_PAIRS;
            else usage();
            break;
        case 'p': opt.pubs = atoi(optarg); break;
        case 's': opt.subs = atoi(optarg); break;
        case 'x': opt.stalled = atoi(optarg); break;
        case 'q': opt.qos = atoi(optarg); break;
        case 'z': opt.size = atoi(optarg); break;
        case 'V': opt.protocol = atoi(optarg); break;
        case 'w': opt.window = atoi(optarg); break;
        case 'r': opt.rate = atof(optarg); break;
        case 'W': opt.warmup = atof(optarg); break;
        case 'd': opt.duration = atof(optarg); break;
        case 'D': opt.drain = atof(optarg); break;
        case 'c': opt.conns = atoi(optarg); break;
        case 'C': opt.concurrency = atoi(optarg); break;
        case 'L': opt.lead = atoi(optarg); break;
        case 'f': opt.prefix = optarg; break;
        case 'T': opt.setup_timeout = atof(optarg); break;
        case 'u': opt.username = optarg; break;
        case 'k': opt.password = optarg; break;
        case 'S': opt.tls = 1; break;
        default: usage();
        }
    }
    if (opt.port <= 0 || opt.port > 65535) die("--port: must be 1..65535");
    if (opt.qos < 0 || opt.qos > 1) die("--qos: must be 0 or 1");
    if (opt.protocol != 4 && opt.protocol != 5) die("--protocol: must be 4 (3.1.1) or 5");
    if (opt.size < PAYLOAD_MIN || opt.size > 65536) die("--size: must be %d..65536", PAYLOAD_MIN);
    if (opt.window < 1 || opt.window > 65535) die("--window: must be 1..65535");
    if (opt.concurrency < 1) die("--concurrency: must be at least 1");
    if (opt.mode == MODE_IDLE) {
        if (opt.conns < 1) die("--conns: must be at least 1 in idle mode");
    } else {
        if (opt.pubs < 1 || opt.subs < 0 || opt.stalled < 0) die("--pubs/--subs: out of range");
        if (opt.topology == TOPO_PAIRS && opt.subs > opt.pubs) die("pairs: --subs > --pubs");
        if (opt.rate <= 0) die("--rate: must be positive");
        if (opt.mode == MODE_STORM && opt.conns < 1) die("--conns: must be at least 1 in storm mode");
    }
    if ((opt.username && strlen(opt.username) > 256) || (opt.password && strlen(opt.password) > 256))
        die("--username/--password: at most 256 bytes");
}

static void raise_nofile(int wanted) {
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    if (rl.rlim_cur < (rlim_t)wanted) {
        rl.rlim_cur = rl.rlim_max < (rlim_t)wanted ? rl.rlim_max : (rlim_t)wanted;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    getrlimit(RLIMIT_NOFILE, &rl);
    if (rl.rlim_cur < (rlim_t)wanted)
        die("RLIMIT_NOFILE is %llu, %d descriptors needed", (unsigned long long)rl.rlim_cur,
            wanted);
}

int main(int argc, char **argv) {
    parse_args(argc, argv);
    signal(SIGPIPE, SIG_IGN);
    if (opt.mode == MODE_IDLE) {
        npubs = 0;
        nsubs = 0;
        nconns = opt.conns;
    } else {
        npubs = opt.pubs;
        nsubs = opt.subs + opt.stalled;
        nconns = npubs + nsubs + (opt.mode == MODE_STORM ? opt.conns : 0);
    }
    nstream = opt.mode == MODE_STORM ? npubs + nsubs : nconns;
    if (opt.tls)
        tls_init();
    raise_nofile(nconns + 64);
    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0)
        die("epoll_create1: %s", strerror(errno));
    conns = xmalloc(sizeof *conns * (size_t)nconns);
    for (int i = 0; i < nconns; i++) {
        struct conn *c = &conns[i];
        c->fd = -1;
        c->window = (uint32_t)opt.window;
        if (opt.mode == MODE_IDLE) {
            c->role = ROLE_IDLE;
            c->index = i;
        } else if (i >= nstream) { /* storm clients */
            c->role = ROLE_IDLE;
            c->index = i - nstream;
        } else if (i < npubs) {
            c->role = ROLE_PUB;
            c->index = i;
            build_publish_template(c);
        } else {
            int k = i - npubs;
            c->role = k < opt.subs ? ROLE_SUB : ROLE_STALLED;
            c->index = k < opt.subs ? k : k - opt.subs;
            c->next_seq = xmalloc(sizeof(uint64_t) * (size_t)npubs);
        }
    }
    int rc = opt.mode == MODE_IDLE ? run_idle() : run_traffic();
    unsigned char bye[2] = {0xe0, 0};
    for (int i = 0; i < nconns; i++) {
        struct conn *c = &conns[i];
        if (c->state != ST_CLOSED && c->state != ST_NEW) {
            if (io_write(c, bye, 2) < 0) { /* best effort: the broker sees a clean goodbye */
            }
            close_conn(c, 1);
        }
    }
    return rc;
}
