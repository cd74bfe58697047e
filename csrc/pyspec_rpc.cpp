// A guard around llama.cpp's RPC backend (ggml-rpc), so that a lost, silent or
// lying rpc-server becomes a status code instead of ending or hanging the process.
//
// Why it is needed: at this revision (0c1e57098, protocol 7.0.0) ggml-rpc reports
// every failed send or receive, and every answer of another size than it expects,
// with GGML_ABORT("Remote RPC server crashed or returned malformed response")
// (RPC_STATUS_ASSERT in ggml/src/ggml-rpc/ggml-rpc.cpp), and its sockets have no
// timeout. Since protocol 7 every command after HELLO is sent from a dispatcher
// thread of ggml-rpc's own (rpc_dispatcher::work) while the caller waits on a
// future, so an abort there has no frame of ours to unwind to. llama.cpp is not
// patched; instead ggml-rpc never talks to a server directly:
//
//  - the relay: pyspec_rpc_watch opens a listener on 127.0.0.1 for each server,
//    and ggml-rpc is given that address. Each connection ggml-rpc opens is paired
//    with one to the server, and two threads pass the bytes along, following the
//    framing (request: command byte | u64 size | payload; answer: u64 size |
//    payload; ggml-rpc waits for each answer before it sends the next command).
//    The relay knows the size of each command's answer, and checks the server's:
//    an answer of another size, bytes nobody asked for, or a reported number out
//    of bounds (device count, alignment, memory) count as a lost connection.
//  - the stand-in: once a connection is lost (the server closed it, failed a send,
//    broke the framing, passed a guarded call's deadline, or was retired), the
//    relay answers ggml-rpc itself: the answer in flight is completed and every
//    later command is answered with zeros of the size it expects. ggml-rpc's
//    dispatcher thread never sees a failure, so it never aborts; the guarded call
//    waiting on it returns, and sees that its servers lost a connection meanwhile
//    (PYSPEC_RPC_LOST, or PYSPEC_RPC_TIMEOUT past its deadline). Zeros are safe
//    answers: an allocation of zero bytes fails, a copy reports failure, a
//    tensor read is zeros the caller is told not to trust, and HELLO reads as
//    protocol 0.0.0, which ggml-rpc refuses ("RPC handshake failed").
//  - guarded calls: decode, encode, process, model load, context creation, device
//    memory and adding a server run inside guarded(). ggml_abort calls the abort
//    callback before abort(); inside a guarded call on this thread it throws
//    instead, for ggml-rpc's refusals and for any abort after one of the call's
//    servers was lost (the stand-in's zeros may trip an assert on the caller's
//    thread), and guarded() turns it into a status. The exception unwinds
//    through ggml_abort (C code, built with unwind tables on x86-64 and aarch64
//    Linux) and through ggml-rpc and llama.cpp frames, whose destructors run.
//  - the file doors (pyspec_model_load_checked and its two siblings) are guarded calls
//    without servers in which every GGML_ASSERT on the calling thread throws: llama.cpp
//    asserts on values it reads from a GGUF (a layer count of 0, ...) fail the load.
//
// The RDMA transport ggml-rpc can negotiate in HELLO is refused by the relay (it
// clears the capabilities both ways): everything goes over its TCP connections.

#include "ggml.h"
#include "ggml-backend.h"
#include "llama.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "pyspec_errbuf.h"

extern "C" {
// keep in step with pyspec/decl/pyspec_rpc.h
enum pyspec_rpc_status {
    PYSPEC_RPC_OK          =  0,
    PYSPEC_RPC_LOST        = -1, // the connection failed (server gone, or a malformed answer)
    PYSPEC_RPC_TIMEOUT     = -2, // the call passed its deadline; its connections were closed
    PYSPEC_RPC_ERROR       = -3, // another C++ exception (message: pyspec_ext_last_error)
    PYSPEC_RPC_UNAVAILABLE = -4, // this build has no RPC backend
    PYSPEC_RPC_REFUSED     = -5, // the server could not be reached, or speaks another protocol version
    PYSPEC_RPC_BAD_ARG     = -6, // an endpoint that is not host:port, or a host that does not resolve
};
}

namespace {

using clock_type = std::chrono::steady_clock;

// the message of RPC_STATUS_ASSERT in ggml-rpc.cpp
const char * const k_rpc_abort_message = "Remote RPC server crashed or returned malformed response";
// rpc_dispatcher::start's aborts (ggml-rpc.cpp at 0c1e57098), on the caller's thread: a server
// that cannot be reached or answers HELLO with another protocol version
const char * const k_rpc_refused_messages[] = {"RPC handshake failed for ", "Failed to connect to "};

// enum rpc_cmd and the answers' sizes (the rpc_msg_*_rsp structs, packed) of ggml-rpc.cpp,
// protocol 7.0.0; tests/test_rpc_peers.py derives them from the vendored source
enum : uint8_t {
    CMD_ALLOC_BUFFER = 0, CMD_GET_ALIGNMENT = 1, CMD_GET_MAX_SIZE = 2, CMD_BUFFER_GET_BASE = 3,
    CMD_SET_TENSOR_HASH = 7, CMD_GET_TENSOR = 8, CMD_COPY_TENSOR = 9, CMD_GET_DEVICE_MEMORY = 11,
    CMD_GET_ALLOC_SIZE = 13, CMD_HELLO = 14, CMD_DEVICE_COUNT = 15,
};
constexpr uint64_t k_conn_caps_size = 24;  // RPC_CONN_CAPS_SIZE (transport.h)
constexpr uint64_t k_hello_rsp_size = 4 + k_conn_caps_size;
constexpr uint64_t k_no_answer = UINT64_MAX;
// the bounds rpc.probe_peer applies (pyspec/core/rpc.py), for ggml-rpc's own connection
constexpr uint32_t k_max_devices = 16;
constexpr uint64_t k_max_alignment = 1ull << 20;
constexpr uint64_t k_max_memory = 1ull << 50;
// commands that expect an answer carry small requests; a larger one is not ggml-rpc's
constexpr uint64_t k_max_asking_request = 1 << 16;

// The size of the answer to `cmd` (k_no_answer: none), given its whole request.
uint64_t answer_size(uint8_t cmd, const std::vector<uint8_t> & req) {
    switch (cmd) {
        case CMD_ALLOC_BUFFER:      return 16;
        case CMD_GET_ALIGNMENT:     return 8;
        case CMD_GET_MAX_SIZE:      return 8;
        case CMD_BUFFER_GET_BASE:   return 8;
        case CMD_SET_TENSOR_HASH:   return 1;
        case CMD_COPY_TENSOR:       return 1;
        case CMD_GET_DEVICE_MEMORY: return 16;
        case CMD_GET_ALLOC_SIZE:    return 8;
        case CMD_HELLO:             return k_hello_rsp_size;
        case CMD_DEVICE_COUNT:      return 4;
        case CMD_GET_TENSOR: {      // rpc_msg_get_tensor_req ends with the u64 size it asks for
            uint64_t size = 0;
            if (req.size() >= sizeof(size)) {
                std::memcpy(&size, req.data() + req.size() - sizeof(size), sizeof(size));
            }
            return size;
        }
        default:                    return k_no_answer;
    }
}

bool asks(uint8_t cmd) {
    return answer_size(cmd, {}) != k_no_answer || cmd == CMD_GET_TENSOR;
}

// Whether a small answer's numbers are within the bounds (a false answer is a lost connection).
bool answer_in_bounds(uint8_t cmd, const uint8_t * body) {
    uint64_t a = 0, b = 0;
    switch (cmd) {
        case CMD_DEVICE_COUNT: {
            uint32_t n = 0;
            std::memcpy(&n, body, sizeof(n));
            return n >= 1 && n <= k_max_devices;
        }
        case CMD_GET_ALIGNMENT:
            std::memcpy(&a, body, 8);
            return a > 0 && a <= k_max_alignment && (a & (a - 1)) == 0;
        case CMD_GET_DEVICE_MEMORY:
            std::memcpy(&a, body, 8);
            std::memcpy(&b, body + 8, 8);
            return b <= k_max_memory && a <= b;
        default:
            return true;
    }
}

struct rpc_lost : std::runtime_error {
    using std::runtime_error::runtime_error;
    bool refused = false;
};

bool is_refusal(const char * message) {
    return message != nullptr && std::any_of(std::begin(k_rpc_refused_messages), std::end(k_rpc_refused_messages),
                                             [&](const char * m) { return std::strstr(message, m) != nullptr; });
}

struct endpoint {
    std::string name;     // "host:port" as given
    sockaddr_in addr{};   // resolved as ggml-rpc resolves it (IPv4)
    uint64_t losses = 0;  // connections lost (a model loaded before a loss is unusable)
    std::string last_loss; // why the latest one was
    int listener = -1;    // the relay's listening socket on 127.0.0.1
    std::string relay;    // "127.0.0.1:port": the address ggml-rpc is given
};

// One connection ggml-rpc opened to the relay, and the relay's to the server.
struct relay_pair {
    int32_t ep = -1;
    int client = -1;           // the relay's end of ggml-rpc's connection
    int upstream = -1;         // the relay's connection to the server (-1: none made)
    std::mutex mu;             // the fields below, and every write to `client`
    bool connected = false;    // the server was reached (a loss counts only then)
    bool lost = false;         // the stand-in answers from now on
    bool client_open = true;   // ggml-rpc has not closed its end
    int threads = 2;           // relay threads still running; the last closes both sockets
    // the one answer ggml-rpc waits for
    bool pending = false;
    uint8_t cmd = 0;
    uint64_t size = 0;         // its payload's size
    bool header_sent = false;
    uint64_t sent = 0;         // payload bytes given to ggml-rpc
};
using pair_ptr = std::shared_ptr<relay_pair>;

struct call {           // a guarded call in progress
    std::vector<int32_t> eps;
    uint64_t losses_at_enter = 0;
    bool has_deadline = false;
    clock_type::time_point deadline;
    bool timed_out = false;
    bool failed = false;  // the abort callback threw for this call
    bool refused = false; // ... for a server that could not be reached or speaks another version
    bool asserts_throw = false; // every GGML_ASSERT on this thread fails the call (a file door's load)
};

struct guard_state {
    std::mutex mu;
    std::vector<endpoint> eps;
    std::vector<pair_ptr> pairs;
    std::vector<call *> calls;
    double connect_timeout_s = 10.0; // the relay's connect to a server (the latest connect deadline given)
    bool watchdog_running = false;
    bool installed = false;
    ggml_abort_callback_t previous = nullptr;
};

// never destroyed: the relay and watchdog threads may still run while static destructors do
guard_state & S() {
    static guard_state * s = new guard_state;
    return *s;
}

thread_local call * t_call = nullptr;

bool send_all(int fd, const void * data, size_t n) {
    const char * p = (const char *) data;
    while (n > 0) {
        const ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            return false;
        }
        p += k;
        n -= (size_t) k;
    }
    return true;
}

// a header and its data in one send: one segment, one wake-up of the reader
bool send_two(int fd, const void * a, size_t na, const void * b, size_t nb) {
    iovec iov[2] = {{const_cast<void *>(a), na}, {const_cast<void *>(b), nb}};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = 2;
    while (msg.msg_iovlen > 0) {
        const ssize_t k = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            return false;
        }
        size_t left = (size_t) k;
        while (msg.msg_iovlen > 0 && left >= msg.msg_iov[0].iov_len) {
            left -= msg.msg_iov[0].iov_len;
            msg.msg_iov++;
            msg.msg_iovlen--;
        }
        if (msg.msg_iovlen > 0) {
            msg.msg_iov[0].iov_base = (char *) msg.msg_iov[0].iov_base + left;
            msg.msg_iov[0].iov_len -= left;
        }
    }
    return true;
}

bool recv_all(int fd, void * data, size_t n) {
    char * p = (char *) data;
    while (n > 0) {
        const ssize_t k = recv(fd, p, n, 0);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            return false;
        }
        p += k;
        n -= (size_t) k;
    }
    return true;
}

bool send_zeros(int fd, uint64_t n) {
    static const char zeros[65536] = {};
    while (n > 0) {
        const size_t k = (size_t) std::min<uint64_t>(n, sizeof(zeros));
        if (!send_all(fd, zeros, k)) {
            return false;
        }
        n -= k;
    }
    return true;
}

uint64_t losses_of(const guard_state & s, const std::vector<int32_t> & eps) {
    uint64_t n = 0;
    for (int32_t ep : eps) {
        if (ep >= 0 && (size_t) ep < s.eps.size()) {
            n += s.eps[ep].losses;
        }
    }
    return n;
}

bool in_call(const call * cl, int32_t ep) {
    return cl == nullptr || std::find(cl->eps.begin(), cl->eps.end(), ep) != cl->eps.end();
}

// Finish the answer ggml-rpc waits for with zeros. Caller holds p.mu.
void complete_pending(relay_pair & p) {
    if (!p.pending) {
        return;
    }
    p.pending = false;
    if (!p.client_open) {
        return;
    }
    if (!p.header_sent && !send_all(p.client, &p.size, sizeof(p.size))) {
        return;
    }
    send_zeros(p.client, p.size - p.sent);
}

// From now on the stand-in answers on this pair. Caller holds s.mu and p.mu.
void lose(guard_state & s, relay_pair & p, const std::string & why) {
    if (p.lost) {
        return;
    }
    p.lost = true;
    if (p.connected) {
        s.eps[p.ep].losses++;
        s.eps[p.ep].last_loss = why;
    }
    if (p.upstream >= 0) {
        shutdown(p.upstream, SHUT_RDWR); // the other relay thread's receive returns
    }
    complete_pending(p);
}

void lose(relay_pair & p, const std::string & why) {
    guard_state & s = S();
    std::lock_guard<std::mutex> lock(s.mu);
    std::lock_guard<std::mutex> plock(p.mu);
    lose(s, p, why);
}

// A relay thread is done; the last one closes the sockets and forgets the pair.
void thread_done(const pair_ptr & p) {
    guard_state & s = S();
    std::lock_guard<std::mutex> lock(s.mu);
    std::lock_guard<std::mutex> plock(p->mu);
    if (--p->threads > 0) {
        return;
    }
    close(p->client);
    if (p->upstream >= 0) {
        close(p->upstream);
    }
    s.pairs.erase(std::remove(s.pairs.begin(), s.pairs.end(), p), s.pairs.end());
}

void no_delay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// The server's answers, to ggml-rpc: each checked against the size it must have.
void relay_answers(pair_ptr p) {
    std::vector<uint8_t> buf(1 << 18);
    uint8_t header[8];
    size_t have = 0;                 // header bytes read so far
    bool header_checked = false;     // the header is read and has the expected size
    std::vector<uint8_t> small;      // an answer of up to 64 bytes is checked whole before it is passed on
    for (;;) {
        const ssize_t n = recv(p->upstream, buf.data(), buf.size(), 0);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        guard_state & s = S();
        std::lock_guard<std::mutex> lock(s.mu);
        std::lock_guard<std::mutex> plock(p->mu);
        if (p->lost || !p->client_open) {
            break;
        }
        if (n <= 0) {
            lose(s, *p, n == 0 ? "the server closed the connection" : "the connection to the server failed");
            break;
        }
        const uint8_t * d = buf.data();
        size_t left = (size_t) n;
        std::string why;  // set when the server broke the protocol
        while (left > 0 && why.empty()) {
            if (!p->pending) {
                why = "the server sent bytes nobody asked for";
            } else if (!header_checked) {
                const size_t k = std::min(left, sizeof(header) - have);
                std::memcpy(header + have, d, k);
                have += k, d += k, left -= k;
                if (have == sizeof(header)) {
                    uint64_t size = 0;
                    std::memcpy(&size, header, sizeof(size));
                    have = 0;
                    small.clear();
                    if (size != p->size) {
                        why = "the server announced a reply of " + std::to_string(size) + " bytes to command " +
                              std::to_string(p->cmd) + ", which has " + std::to_string(p->size);
                    } else if (p->size > 0) {
                        header_checked = true; // sent with the first bytes of the payload
                    } else if (send_all(p->client, header, sizeof(header))) {
                        p->header_sent = true;
                    }
                }
            } else if (p->size <= 64) {
                const size_t k = std::min<size_t>(left, p->size - small.size());
                small.insert(small.end(), d, d + k);
                d += k, left -= k;
                if (small.size() == p->size) {
                    if (p->cmd == CMD_HELLO && small.size() == k_hello_rsp_size) {
                        std::fill(small.begin() + 4, small.end(), 0); // no RDMA: the relay stays in the path
                    }
                    if (!answer_in_bounds(p->cmd, small.data())) {
                        why = "the server reported a value out of bounds in its reply to command " +
                              std::to_string(p->cmd);
                    } else if (send_two(p->client, header, sizeof(header), small.data(), small.size())) {
                        p->header_sent = true;
                        p->sent = p->size;
                    }
                }
            } else {
                const size_t k = (size_t) std::min<uint64_t>(left, p->size - p->sent);
                if (p->sent == 0 ? send_two(p->client, header, sizeof(header), d, k) : send_all(p->client, d, k)) {
                    p->header_sent = true;
                    p->sent += k;
                }
                d += k, left -= k;
            }
            if (p->pending && p->header_sent && p->sent == p->size) {
                p->pending = false;
                header_checked = false;
            }
        }
        if (!why.empty()) {
            lose(s, *p, why);
            break;
        }
    }
    thread_done(p);
}

// Make the relay's connection to the server, within the connect deadline.
int connect_upstream(const sockaddr_in & addr, double timeout_s) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        return -1;
    }
    timeval tv{};
    tv.tv_sec = (time_t) timeout_s;
    tv.tv_usec = (suseconds_t) ((timeout_s - (double) tv.tv_sec) * 1e6);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)); // bounds connect() on Linux
    if (connect(fd, (const sockaddr *) &addr, sizeof(addr)) != 0) {
        close(fd);
        return -1;
    }
    tv = {};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)); // sends wait: the guard's deadlines bound them
    no_delay(fd);
    return fd;
}

// ggml-rpc's commands, to the server (or, once lost, to the stand-in).
void relay_commands(pair_ptr p, sockaddr_in addr, double timeout_s) {
    guard_state & s = S();
    const int up = connect_upstream(addr, timeout_s);
    bool relay_back;
    {
        std::lock_guard<std::mutex> lock(s.mu);
        std::lock_guard<std::mutex> plock(p->mu);
        p->upstream = up;
        p->connected = up >= 0 && !p->lost;
        relay_back = up >= 0 && !p->lost;
        if (!relay_back) {
            p->threads--; // no answers to relay
            p->lost = true;
            if (up >= 0) {
                shutdown(up, SHUT_RDWR);
            }
        }
    }
    if (relay_back) {
        std::thread(relay_answers, p).detach();
    }
    // sends to the server are made without the pair's lock: a server that stops reading
    // blocks them until the watchdog's shutdown, and the watchdog must get the lock
    std::vector<uint8_t> chunk(1 << 16);
    std::vector<uint8_t> req;
    for (;;) {
        uint8_t header[9];
        if (!recv_all(p->client, header, sizeof(header))) {
            break; // ggml-rpc closed its connection
        }
        const uint8_t cmd = header[0];
        uint64_t size = 0;
        std::memcpy(&size, header + 1, sizeof(size));
        bool lost;
        if (asks(cmd)) {
            if (size > k_max_asking_request) {
                break; // not ggml-rpc's framing: nothing sensible to answer
            }
            req.resize(size);
            if (!recv_all(p->client, req.data(), size)) {
                break;
            }
            if (cmd == CMD_HELLO) {
                std::fill(req.begin(), req.end(), 0); // no RDMA capabilities offered
            }
            {
                std::lock_guard<std::mutex> plock(p->mu);
                p->pending = true;
                p->cmd = cmd;
                p->size = answer_size(cmd, req);
                p->header_sent = false;
                p->sent = 0;
                lost = p->lost;
                if (lost) {
                    complete_pending(*p);
                }
            }
            if (!lost && !send_two(p->upstream, header, sizeof(header), req.data(), size)) {
                lose(*p, "a send to the server failed");
            }
            continue;
        }
        {
            std::lock_guard<std::mutex> plock(p->mu);
            lost = p->lost;
        }
        bool up_ok = !lost;
        bool client_ok = true;
        bool first = true;
        while ((size > 0 || first) && client_ok) {
            const size_t k = (size_t) std::min<uint64_t>(size, chunk.size());
            client_ok = recv_all(p->client, chunk.data(), k);
            size -= k;
            up_ok = up_ok && client_ok &&
                    (first ? send_two(p->upstream, header, sizeof(header), chunk.data(), k)
                           : send_all(p->upstream, chunk.data(), k));
            first = false;
        }
        if (!client_ok) {
            break;
        }
        if (!lost && !up_ok) {
            lose(*p, "a send to the server failed");
        }
    }
    {
        std::lock_guard<std::mutex> lock(s.mu);
        std::lock_guard<std::mutex> plock(p->mu);
        p->client_open = false;
        p->pending = false;
        if (p->upstream >= 0) {
            shutdown(p->upstream, SHUT_RDWR);
        }
    }
    thread_done(p);
}

// The relay's listener for endpoint `ep`: one pair per connection ggml-rpc opens.
void relay_accept(int32_t ep, int listener, sockaddr_in addr) {
    guard_state & s = S();
    for (;;) {
        const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) {
                std::this_thread::sleep_for(std::chrono::milliseconds(errno == EINTR ? 0 : 10));
                continue;
            }
            return;
        }
        no_delay(fd);
        auto p = std::make_shared<relay_pair>();
        p->ep = ep;
        p->client = fd;
        double timeout_s;
        {
            std::lock_guard<std::mutex> lock(s.mu);
            s.pairs.push_back(p);
            timeout_s = s.connect_timeout_s;
        }
        std::thread(relay_commands, p, addr, timeout_s).detach();
    }
}

// The watchdog: a guarded call past its deadline loses its servers' connections.
void watchdog_loop() {
    guard_state & s = S();
    for (;;) {
        {
            std::lock_guard<std::mutex> lock(s.mu);
            if (s.calls.empty()) {
                s.watchdog_running = false;
                return;
            }
            const auto now = clock_type::now();
            for (call * cl : s.calls) {
                if (cl->has_deadline && !cl->timed_out && now >= cl->deadline) {
                    cl->timed_out = true;
                    for (const auto & p : s.pairs) {
                        std::lock_guard<std::mutex> plock(p->mu);
                        if (in_call(cl, p->ep) && p->client_open) {
                            lose(s, *p, "no answer before a call's deadline");
                        }
                    }
                }
            }
        }
        // 50 ms: the resolution of deadlines
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
}

void start_watchdog(guard_state & s) {
    if (!s.watchdog_running) {
        s.watchdog_running = true;
        std::thread(watchdog_loop).detach();
    }
}

// The server side closed or reset the connection.
bool peer_gone(int fd) {
    int err = 0;
    socklen_t len = sizeof(err);
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err != 0) {
        return true;
    }
    pollfd p = {fd, (short) (POLLIN | POLLRDHUP), 0};
    if (poll(&p, 1, 0) <= 0) {
        return false;
    }
    return (p.revents & (POLLERR | POLLHUP | POLLRDHUP | POLLNVAL)) != 0;
}

// Lose the live pairs of `cl`'s endpoints whose server is gone (all of them with `all`). Caller holds s.mu.
int lose_pairs(guard_state & s, const call * cl, bool all) {
    int n = 0;
    for (const auto & p : s.pairs) {
        std::lock_guard<std::mutex> plock(p->mu);
        if (!p->lost && p->client_open && in_call(cl, p->ep) && (all || (p->upstream >= 0 && peer_gone(p->upstream)))) {
            lose(s, *p, all ? "the connection was retired" : "the server closed the connection");
            n++;
        }
    }
    return n;
}

void on_ggml_abort(const char * message) {
    guard_state & s = S();
    call * cl = t_call;
    if (cl != nullptr && std::uncaught_exceptions() == 0) {
        if (is_refusal(message)) {
            cl->failed = cl->refused = true;
            rpc_lost e("the RPC server refused the connection or speaks another RPC protocol version");
            e.refused = true;
            throw e;
        }
        bool lost = message != nullptr && std::strstr(message, k_rpc_abort_message) != nullptr;
        {
            std::lock_guard<std::mutex> lock(s.mu);
            lost = lost || losses_of(s, cl->eps) != cl->losses_at_enter;
        }
        if (lost) { // an assert on the stand-in's zeros, or ggml-rpc's own check
            cl->failed = true;
            throw rpc_lost(cl->timed_out ? "the RPC server did not answer before the deadline"
                                         : "the connection to the RPC server was lost");
        }
        if (cl->asserts_throw) { // llama.cpp's loaders catch it and fail the load
            std::string what = message ? message : "ggml_abort";
            const size_t tree = what.find("/llama.cpp/"); // the source path from the vendored tree on
            throw std::runtime_error("llama.cpp refused the file: " +
                                     (tree == std::string::npos ? what : what.substr(tree + 1)));
        }
    }
    if (s.previous != nullptr) {
        s.previous(message);
    } else {
        std::fprintf(stderr, "%s\n", message ? message : "ggml_abort");
    }
    // abort() follows
}

void enter(call & cl, const int32_t * eps, int32_t n_eps, double timeout_s) {
    guard_state & s = S();
    if (eps != nullptr && n_eps > 0) {
        cl.eps.assign(eps, eps + n_eps);
    }
    if (timeout_s > 0) {
        cl.has_deadline = true;
        cl.deadline = clock_type::now() + std::chrono::duration_cast<clock_type::duration>(
                                              std::chrono::duration<double>(timeout_s));
    }
    std::lock_guard<std::mutex> lock(s.mu);
    cl.losses_at_enter = losses_of(s, cl.eps);
    s.calls.push_back(&cl);
    if (cl.has_deadline) {
        start_watchdog(s);
    }
}

// The status of a finished call, given what its own catch saw.
int32_t leave(call & cl, int32_t status) {
    guard_state & s = S();
    bool lost;
    std::string why;
    {
        std::lock_guard<std::mutex> lock(s.mu);
        s.calls.erase(std::find(s.calls.begin(), s.calls.end(), &cl));
        lost = losses_of(s, cl.eps) != cl.losses_at_enter;
        for (int32_t ep : cl.eps) {
            if (lost && ep >= 0 && (size_t) ep < s.eps.size() && !s.eps[ep].last_loss.empty()) {
                why = s.eps[ep].last_loss;
            }
        }
    }
    if (lost && !why.empty()) {
        pyspec::last_error() = why; // the message of a PYSPEC_RPC_LOST
    }
    // llama.cpp catches exceptions in model loading and context creation itself, and a call
    // answered by the stand-in returns as if it had worked
    if ((cl.failed || lost) && (status == PYSPEC_RPC_OK || status == PYSPEC_RPC_ERROR)) {
        status = cl.refused ? PYSPEC_RPC_REFUSED : PYSPEC_RPC_LOST;
    }
    if (status == PYSPEC_RPC_LOST && cl.timed_out) {
        status = PYSPEC_RPC_TIMEOUT;
    }
    return status;
}

// Run f() as a guarded call on the endpoints `eps` (ids from pyspec_rpc_watch).
template <typename F>
int32_t guarded(const int32_t * eps, int32_t n_eps, double timeout_s, F && f, bool asserts_throw = false) {
    call cl;
    cl.asserts_throw = asserts_throw;
    enter(cl, eps, n_eps, timeout_s);
    call * outer = t_call;
    t_call = &cl;
    int32_t status = PYSPEC_RPC_OK;
    pyspec::last_error().clear();
    try {
        f();
    } catch (const rpc_lost & e) {
        status = e.refused ? PYSPEC_RPC_REFUSED : PYSPEC_RPC_LOST;
        pyspec::last_error() = e.what();
    } catch (const std::exception & e) {
        status = PYSPEC_RPC_ERROR;
        pyspec::last_error() = e.what();
    } catch (...) {
        status = PYSPEC_RPC_ERROR;
        pyspec::last_error() = "unknown C++ exception";
    }
    t_call = outer;
    return leave(cl, status);
}

// the open region of this thread (pyspec_rpc_region_begin / _end), with the call it encloses
thread_local call * t_region = nullptr;
thread_local call * t_region_outer = nullptr;

bool parse_endpoint(const char * endpoint, std::string & host, int & port) {
    const std::string e = endpoint ? endpoint : "";
    const size_t pos = e.rfind(':');
    if (pos == std::string::npos || pos == 0 || pos + 1 >= e.size()) {
        return false;
    }
    host = e.substr(0, pos);
    char * end = nullptr;
    const long p = std::strtol(e.c_str() + pos + 1, &end, 10);
    if (*end != '\0' || p <= 0 || p > 65535) {
        return false;
    }
    port = (int) p;
    return true;
}

// A listener on 127.0.0.1 (any free port) for the relay of one endpoint; -1 on failure.
int open_listener(std::string & name) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        return -1;
    }
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (bind(fd, (const sockaddr *) &a, sizeof(a)) != 0 || listen(fd, 16) != 0 ||
        getsockname(fd, (sockaddr *) &a, &len) != 0) {
        close(fd);
        return -1;
    }
    name = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
    return fd;
}

} // namespace

extern "C" {

// Install the abort callback (once; an earlier callback keeps getting every other abort).
void pyspec_rpc_guard_install(void) {
    guard_state & s = S();
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.installed) {
        s.previous = ggml_set_abort_callback(on_ggml_abort);
        s.installed = true;
    }
}

// Watch "host:port" and open its relay: returns its endpoint id (the same id for the same
// text), or PYSPEC_RPC_BAD_ARG (not host:port, does not resolve) / PYSPEC_RPC_ERROR (no listener).
int32_t pyspec_rpc_watch(const char * endpoint) {
    std::string host;
    int port = 0;
    if (!parse_endpoint(endpoint, host, port)) {
        return PYSPEC_RPC_BAD_ARG;
    }
    guard_state & s = S();
    {
        std::lock_guard<std::mutex> lock(s.mu);
        for (size_t i = 0; i < s.eps.size(); i++) {
            if (s.eps[i].name == endpoint) {
                return (int32_t) i;
            }
        }
    }
    addrinfo hints{};
    hints.ai_family = AF_INET; // ggml-rpc connects over IPv4 (gethostbyname)
    hints.ai_socktype = SOCK_STREAM;
    addrinfo * res = nullptr;
    if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
        return PYSPEC_RPC_BAD_ARG;
    }
    sockaddr_in addr = *(const sockaddr_in *) res->ai_addr;
    freeaddrinfo(res);
    addr.sin_port = htons((uint16_t) port);
    std::string relay;
    const int listener = open_listener(relay);
    if (listener < 0) {
        return PYSPEC_RPC_ERROR;
    }
    std::lock_guard<std::mutex> lock(s.mu);
    s.eps.push_back({endpoint, addr, 0, "", listener, relay});
    const int32_t ep = (int32_t) s.eps.size() - 1;
    std::thread(relay_accept, ep, listener, addr).detach();
    return ep;
}

// The address ggml-rpc is given for endpoint `ep` (its relay, "127.0.0.1:port"), NUL-terminated
// into buf; its length, or PYSPEC_RPC_BAD_ARG for an unknown id or a buffer too small.
int32_t pyspec_rpc_relay_name(int32_t ep, char * buf, int32_t size) {
    guard_state & s = S();
    std::lock_guard<std::mutex> lock(s.mu);
    if (ep < 0 || (size_t) ep >= s.eps.size() || buf == nullptr || size <= (int32_t) s.eps[ep].relay.size()) {
        return PYSPEC_RPC_BAD_ARG;
    }
    std::memcpy(buf, s.eps[ep].relay.c_str(), s.eps[ep].relay.size() + 1);
    return (int32_t) s.eps[ep].relay.size();
}

// The relay's table: the answer size of command `cmd` (GET_TENSOR: the size it asks for,
// `get_size`), or -1 for a command without an answer. For the drift test against ggml-rpc.cpp.
int64_t pyspec_rpc_answer_size(uint8_t cmd, uint64_t get_size) {
    std::vector<uint8_t> req(sizeof(get_size));
    std::memcpy(req.data(), &get_size, sizeof(get_size));
    const uint64_t n = answer_size(cmd, req);
    return n == k_no_answer ? -1 : (int64_t) n;
}

// How often connections to endpoint `ep` were lost (a model loaded before a loss is unusable).
uint64_t pyspec_rpc_losses(int32_t ep) {
    guard_state & s = S();
    std::lock_guard<std::mutex> lock(s.mu);
    return ep >= 0 && (size_t) ep < s.eps.size() ? s.eps[ep].losses : 0;
}

// Open connections to endpoint `ep`: live ones, or lost ones (the stand-in answers) that objects still hold.
int32_t pyspec_rpc_connections(int32_t ep, bool lost) {
    guard_state & s = S();
    std::lock_guard<std::mutex> lock(s.mu);
    int32_t n = 0;
    for (const auto & p : s.pairs) {
        std::lock_guard<std::mutex> plock(p->mu);
        if (p->ep == ep && p->client_open && p->connected && p->lost == lost) {
            n++;
        }
    }
    return n;
}

// Lose the connections of these endpoints whose server is gone (the relay notices on its
// own too; this does it now); the number lost.
int32_t pyspec_rpc_check(const int32_t * eps, int32_t n_eps) {
    guard_state & s = S();
    call cl;
    if (eps != nullptr && n_eps > 0) {
        cl.eps.assign(eps, eps + n_eps);
    }
    std::lock_guard<std::mutex> lock(s.mu);
    return lose_pairs(s, &cl, false);
}

// A guarded region around one call into C++ code of ours that catches std::exception at
// its C boundary (libpyspec_ref: the C++ loop, the reference): the guard's exception ends
// that call with its error status, and region_end says whether the guard fired. Never
// around a llama.cpp function that does not catch (llama_decode): use the wrappers below.
// Begin and end on the same thread, not nested.
int32_t pyspec_rpc_region_begin(const int32_t * eps, int32_t n_eps, double timeout_s) {
    if (t_region != nullptr) {
        return PYSPEC_RPC_BAD_ARG;
    }
    t_region = new call;
    enter(*t_region, eps, n_eps, timeout_s);
    t_region_outer = t_call;
    t_call = t_region;
    return PYSPEC_RPC_OK;
}

int32_t pyspec_rpc_region_end(void) {
    call * cl = t_region;
    if (cl == nullptr) {
        return PYSPEC_RPC_BAD_ARG;
    }
    t_call = t_region_outer;
    t_region = nullptr;
    const int32_t status = leave(*cl, PYSPEC_RPC_OK);
    delete cl;
    return status;
}

// Lose every connection to endpoint `ep` on purpose (its server is being stopped): the
// objects that used it are lost, and free without reaching it. The number lost.
int32_t pyspec_rpc_retire(int32_t ep) {
    guard_state & s = S();
    call cl;
    cl.eps.push_back(ep);
    std::lock_guard<std::mutex> lock(s.mu);
    return lose_pairs(s, &cl, true);
}

// ggml_backend_rpc_add_server, found through the registry (the RPC backend may be a
// dynamically loaded module), guarded: its HELLO exchange aborts on a bad answer. ggml-rpc
// is given the endpoint's relay, not the server (`endpoint` is the watched name).
ggml_backend_reg_t pyspec_rpc_add_server(const char * endpoint, int32_t ep, double timeout_s, int32_t * status) {
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    if (rpc == nullptr) {
        *status = PYSPEC_RPC_UNAVAILABLE;
        return nullptr;
    }
    typedef ggml_backend_reg_t (*add_server_t)(const char * endpoint);
    auto add_server = (add_server_t) ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server");
    if (add_server == nullptr) {
        *status = PYSPEC_RPC_UNAVAILABLE;
        return nullptr;
    }
    std::string relay;
    {
        guard_state & s = S();
        std::lock_guard<std::mutex> lock(s.mu);
        if (ep < 0 || (size_t) ep >= s.eps.size() || s.eps[ep].name != (endpoint ? endpoint : "")) {
            *status = PYSPEC_RPC_BAD_ARG;
            return nullptr;
        }
        relay = s.eps[ep].relay;
        if (timeout_s > 0) {
            s.connect_timeout_s = timeout_s;
        }
    }
    ggml_backend_reg_t reg = nullptr;
    *status = guarded(&ep, 1, timeout_s, [&] { reg = add_server(relay.c_str()); });
    if (*status == PYSPEC_RPC_OK && reg == nullptr) {
        *status = PYSPEC_RPC_REFUSED;
    }
    return *status == PYSPEC_RPC_OK ? reg : nullptr;
}

int32_t pyspec_rpc_dev_memory(ggml_backend_dev_t dev, size_t * free, size_t * total,
                              const int32_t * eps, int32_t n_eps, double timeout_s) {
    *free = *total = 0;
    return guarded(eps, n_eps, timeout_s, [&] { ggml_backend_dev_memory(dev, free, total); });
}

int32_t pyspec_rpc_decode(struct llama_context * ctx, struct llama_batch batch,
                          const int32_t * eps, int32_t n_eps, double timeout_s, int32_t * result) {
    *result = -1;
    return guarded(eps, n_eps, timeout_s, [&] { *result = llama_decode(ctx, batch); });
}

int32_t pyspec_rpc_encode(struct llama_context * ctx, struct llama_batch batch,
                          const int32_t * eps, int32_t n_eps, double timeout_s, int32_t * result) {
    *result = -1;
    return guarded(eps, n_eps, timeout_s, [&] { *result = llama_encode(ctx, batch); });
}

int32_t pyspec_rpc_process(struct llama_context * ctx, int32_t type, struct llama_batch_ext * batch,
                           const int32_t * eps, int32_t n_eps, double timeout_s, int32_t * result) {
    *result = -1;
    return guarded(eps, n_eps, timeout_s,
                   [&] { *result = llama_process(ctx, (enum llama_process_type) type, batch); });
}

struct llama_model * pyspec_rpc_model_load(const char * path, struct llama_model_params params,
                                           const int32_t * eps, int32_t n_eps, double timeout_s, int32_t * status) {
    llama_model * model = nullptr;
    *status = guarded(eps, n_eps, timeout_s, [&] { model = llama_model_load_from_file(path, params); }, true);
    if (*status != PYSPEC_RPC_OK && model != nullptr) {
        // cannot happen (a failed load returns NULL), but never hand out a half-loaded model
        llama_model_free(model);
        model = nullptr;
    }
    return model;
}

// The file doors (model, split set, LoRA, quantize source) with the load's GGML_ASSERTs
// failing the load: the metadata checks of pyspec.core.gguf_keys come first, and these catch
// the value checks llama.cpp asserts on while it reads a file (a layer count out of range,
// more experts used than there are, ...) in any architecture's loader. The exception is
// caught by llama.cpp's own handler of each door (llama_model_load, the LoRA init, the
// quantizer), which logs it and returns its failure; asserts on other threads (the
// quantizer's workers) still end the process.
struct llama_model * pyspec_model_load_checked(const char ** paths, size_t n_paths,
                                               struct llama_model_params params) {
    pyspec_rpc_guard_install();
    llama_model * model = nullptr;
    const int32_t status = guarded(nullptr, 0, 0.0, [&] {
        model = n_paths == 1 ? llama_model_load_from_file(paths[0], params)
                             : llama_model_load_from_splits(paths, n_paths, params);
    }, true);
    if (status != PYSPEC_RPC_OK && model != nullptr) {
        llama_model_free(model);
        model = nullptr;
    }
    return model;
}

struct llama_adapter_lora * pyspec_adapter_lora_init_checked(struct llama_model * model, const char * path) {
    pyspec_rpc_guard_install();
    llama_adapter_lora * adapter = nullptr;
    const int32_t status = guarded(nullptr, 0, 0.0, [&] { adapter = llama_adapter_lora_init(model, path); }, true);
    if (status != PYSPEC_RPC_OK && adapter != nullptr) {
        llama_adapter_lora_free(adapter);
        adapter = nullptr;
    }
    return adapter;
}

uint32_t pyspec_model_quantize_checked(const char * fname_inp, const char * fname_out,
                                       const struct llama_model_quantize_params * params) {
    pyspec_rpc_guard_install();
    uint32_t rc = 1;
    const int32_t status = guarded(nullptr, 0, 0.0, [&] { rc = llama_model_quantize(fname_inp, fname_out, params); },
                                   true);
    return status == PYSPEC_RPC_OK ? rc : 1;
}

struct llama_context * pyspec_rpc_init_from_model(struct llama_model * model, struct llama_context_params params,
                                                  const int32_t * eps, int32_t n_eps, double timeout_s,
                                                  int32_t * status) {
    llama_context * ctx = nullptr;
    *status = guarded(eps, n_eps, timeout_s, [&] { ctx = llama_init_from_model(model, params); });
    if (*status != PYSPEC_RPC_OK && ctx != nullptr) {
        llama_free(ctx);
        ctx = nullptr;
    }
    return ctx;
}

} // extern "C"
