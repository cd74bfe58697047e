// A guard around llama.cpp's RPC backend (ggml-rpc), so that a lost or silent
// rpc-server becomes a status code instead of ending or hanging the process.
//
// Why it is needed: at this revision ggml-rpc reports every failed send or
// receive with GGML_ABORT("Remote RPC server crashed or returned malformed
// response") (RPC_STATUS_ASSERT in ggml/src/ggml-rpc/ggml-rpc.cpp), and its
// sockets have no timeout, so a server that stops answering blocks the caller
// for ever. llama.cpp itself is not patched; instead:
//
//  - guarded calls: decode, encode, model load, context creation, device memory
//    and adding a server run inside guarded(). ggml_abort calls the abort
//    callback before abort(); ours throws rpc_lost when a guarded call is on the
//    thread's stack, guarded() catches it and returns PYSPEC_RPC_LOST. The
//    exception unwinds through ggml_abort (C code, which GCC and Clang build with
//    unwind tables on x86-64 and aarch64 Linux) and through ggml-rpc and
//    llama.cpp frames, whose destructors and lock guards run as usual.
//  - deadlines: a guarded call may have a deadline. A watchdog thread shuts the
//    call's RPC sockets down when it passes; the blocked receive then fails at
//    once and the abort path above turns it into PYSPEC_RPC_TIMEOUT.
//  - sinks: a socket whose server is gone is replaced (dup2) by one end of a
//    local socketpair. The watchdog thread reads and drops what ggml-rpc sends
//    there and keeps zero bytes ready to read, so a later FREE_BUFFER (from the
//    destructors of the models and contexts that used the server, which cannot
//    throw) reads the "0 bytes" answer it expects and succeeds; every call that
//    expects data reads a size that does not match and fails again. Freeing a
//    model after its server died therefore frees it, instead of aborting.
//
// At 0c1e57098 (protocol 7.0.0) ggml-rpc sends every command after HELLO from a
// dispatcher thread of its own (rpc_dispatcher::work), while the caller waits on a
// future. An abort there has no guarded call on its stack, so the callback can only
// return: a server lost or silent in the middle of a call still aborts the process at
// this revision (tests/test_rpc.py's kill and freeze cases). The connection's start
// (connect, HELLO) runs on the caller's thread and is guarded; its aborts for an
// unreachable server or another protocol version become PYSPEC_RPC_REFUSED.
//
// ggml-rpc's sockets are private, so they are found by their peer address in
// /proc/self/fd (Linux). Without a guarded call on the stack (or while an
// exception is already unwinding) the callback can only return, and ggml_abort
// aborts as before: the Python side keeps every RPC call that can fail inside
// one of the functions below, and checks (pyspec_rpc_check) before it frees.

#include "ggml.h"
#include "ggml-backend.h"
#include "llama.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
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

struct rpc_lost : std::runtime_error {
    using std::runtime_error::runtime_error;
    bool refused = false;
};

bool is_refusal(const char * message) {
    return message != nullptr && std::any_of(std::begin(k_rpc_refused_messages), std::end(k_rpc_refused_messages),
                                             [&](const char * m) { return std::strstr(message, m) != nullptr; });
}

struct endpoint {
    std::string name;   // "host:port" as given
    sockaddr_in addr{}; // resolved as ggml-rpc resolves it (IPv4)
    uint64_t losses = 0;
};

struct connection {     // one ggml-rpc client socket to a watched endpoint
    int fd;
    dev_t dev;
    ino_t ino;          // identifies the open socket behind fd (fds are reused)
    int32_t ep;
    int sink_peer = -1; // >= 0 once replaced by a sink: the watchdog's end of the socketpair
};

struct call {           // a guarded call in progress
    std::vector<int32_t> eps;
    bool opens = false;  // it may open connections (load, context creation, adding a server): look after it
    bool has_deadline = false;
    clock_type::time_point deadline;
    bool timed_out = false;
    bool failed = false; // the abort callback ran for this call
    bool refused = false; // ... for a server that could not be reached or speaks another version
};

struct guard_state {
    std::mutex mu;
    std::vector<endpoint> eps;
    std::vector<connection> conns;
    std::vector<call *> calls;
    bool watchdog_running = false;
    bool installed = false;
    ggml_abort_callback_t previous = nullptr;
};

// never destroyed: the watchdog thread may still run while static destructors do
guard_state & S() {
    static guard_state * s = new guard_state;
    return *s;
}

thread_local call * t_call = nullptr;

bool same_file(int fd, dev_t dev, ino_t ino) {
    struct stat st;
    return fstat(fd, &st) == 0 && st.st_dev == dev && st.st_ino == ino;
}

// Record the sockets of watched endpoints that ggml-rpc has opened since the last
// look, and forget the ones it closed. Caller holds mu.
void refresh(guard_state & s) {
    // a closed descriptor (or one reused for another file) is forgotten; a sink's
    // own end is closed by the watchdog, which polls it
    s.conns.erase(std::remove_if(s.conns.begin(), s.conns.end(), [](const connection & c) {
        return c.sink_peer < 0 && !same_file(c.fd, c.dev, c.ino);
    }), s.conns.end());
    if (s.eps.empty()) {
        return;
    }
    DIR * dir = opendir("/proc/self/fd");
    if (dir == nullptr) {
        return;
    }
    const int dir_fd = dirfd(dir);
    while (dirent * e = readdir(dir)) {
        char * end = nullptr;
        const long fd = std::strtol(e->d_name, &end, 10);
        if (end == e->d_name || *end != '\0' || fd == dir_fd) {
            continue;
        }
        struct stat st;
        if (fstat((int) fd, &st) != 0 || !S_ISSOCK(st.st_mode)) {
            continue;
        }
        const bool known = std::any_of(s.conns.begin(), s.conns.end(), [&](const connection & c) {
            return c.fd == fd && c.dev == st.st_dev && c.ino == st.st_ino;
        });
        if (known) {
            continue;
        }
        sockaddr_in peer{};
        socklen_t len = sizeof(peer);
        if (getpeername((int) fd, (sockaddr *) &peer, &len) != 0 || peer.sin_family != AF_INET) {
            continue;
        }
        for (size_t i = 0; i < s.eps.size(); i++) {
            const sockaddr_in & a = s.eps[i].addr;
            if (peer.sin_port == a.sin_port && peer.sin_addr.s_addr == a.sin_addr.s_addr) {
                s.conns.push_back({(int) fd, st.st_dev, st.st_ino, (int32_t) i});
                break;
            }
        }
    }
    closedir(dir);
}

// The server side closed or reset the connection (or we shut it down).
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
    if (p.revents & (POLLERR | POLLHUP | POLLRDHUP | POLLNVAL)) {
        return true;
    }
    char c;
    const ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

void start_watchdog(guard_state & s);

// Replace the socket behind c.fd by a sink (see the top of the file). Caller holds mu.
void sink(guard_state & s, connection & c) {
    shutdown(c.fd, SHUT_RDWR); // wakes any thread blocked on the old socket
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        return; // the shut-down socket fails every call: no sink, but no hang either
    }
    fcntl(sv[1], F_SETFL, O_NONBLOCK);
    if (dup2(sv[0], c.fd) < 0) {
        close(sv[0]);
        close(sv[1]);
        return;
    }
    close(sv[0]);
    struct stat st;
    if (fstat(c.fd, &st) == 0) {
        c.dev = st.st_dev;
        c.ino = st.st_ino;
    }
    c.sink_peer = sv[1];
    s.eps[c.ep].losses++;
    start_watchdog(s);
}

bool in_call(const call * cl, int32_t ep) {
    return cl == nullptr || std::find(cl->eps.begin(), cl->eps.end(), ep) != cl->eps.end();
}

// Sink the connections of `cl`'s endpoints (all endpoints when cl is null) whose
// server is gone; with `all`, sink every one of them. Caller holds mu.
int sink_lost(guard_state & s, const call * cl, bool all) {
    int n = 0;
    for (auto & c : s.conns) {
        if (c.sink_peer < 0 && in_call(cl, c.ep) && (all || peer_gone(c.fd))) {
            sink(s, c);
            n++;
        }
    }
    return n;
}

// The watchdog: enforces deadlines, and serves the sinks while any exist.
void watchdog_loop() {
    guard_state & s = S();
    static const char zeros[4096] = {};
    char scratch[4096];
    for (;;) {
        std::vector<int> peers;
        {
            std::lock_guard<std::mutex> lock(s.mu);
            // forget sinks whose descriptor ggml-rpc has closed (its socket object is gone)
            for (auto it = s.conns.begin(); it != s.conns.end();) {
                if (it->sink_peer >= 0 && !same_file(it->fd, it->dev, it->ino)) {
                    close(it->sink_peer);
                    it = s.conns.erase(it);
                } else {
                    ++it;
                }
            }
            const auto now = clock_type::now();
            for (call * cl : s.calls) {
                if (cl->has_deadline && !cl->timed_out && now >= cl->deadline) {
                    cl->timed_out = true;
                    refresh(s); // a connection opened during the call (e.g. one still waiting for HELLO)
                    for (auto & c : s.conns) {
                        if (c.sink_peer < 0 && in_call(cl, c.ep)) {
                            shutdown(c.fd, SHUT_RDWR); // the blocked receive returns; the call fails
                        }
                    }
                }
            }
            for (const auto & c : s.conns) {
                if (c.sink_peer >= 0) {
                    peers.push_back(c.sink_peer);
                }
            }
            if (peers.empty() && s.calls.empty()) {
                s.watchdog_running = false;
                return;
            }
            // top up the "0 bytes" answers, drop what ggml-rpc sent
            for (int fd : peers) {
                while (read(fd, scratch, sizeof(scratch)) > 0) {
                }
                while (write(fd, zeros, sizeof(zeros)) > 0) {
                }
            }
        }
        std::vector<pollfd> pfds;
        for (int fd : peers) {
            pfds.push_back({fd, POLLIN, 0});
        }
        // 50 ms: the resolution of deadlines; a sink is topped up at least that often
        poll(pfds.data(), pfds.size(), 50);
    }
}

void start_watchdog(guard_state & s) {
    if (!s.watchdog_running) {
        s.watchdog_running = true;
        std::thread(watchdog_loop).detach();
    }
}

void on_ggml_abort(const char * message) {
    guard_state & s = S();
    const bool refused = t_call != nullptr && is_refusal(message);
    if (refused && std::uncaught_exceptions() == 0) {
        t_call->failed = true;
        t_call->refused = true;
        rpc_lost e("the RPC server refused the connection or speaks another RPC protocol version");
        e.refused = true;
        throw e;
    }
    const bool rpc = message != nullptr && std::strstr(message, k_rpc_abort_message) != nullptr;
    if (!rpc) {
        if (s.previous != nullptr) {
            s.previous(message);
        } else {
            std::fprintf(stderr, "%s\n", message ? message : "ggml_abort");
        }
        return; // abort() follows
    }
    call * cl = t_call;
    {
        std::lock_guard<std::mutex> lock(s.mu);
        refresh(s);
        // the connections whose server is gone; when none is (a malformed answer), all of
        // this call's: their protocol state is unknown after a failed exchange
        if (sink_lost(s, cl, false) == 0 && cl != nullptr) {
            sink_lost(s, cl, true);
        }
    }
    if (cl != nullptr && std::uncaught_exceptions() == 0) {
        cl->failed = true;
        throw rpc_lost(cl->timed_out ? "the RPC server did not answer before the deadline"
                                     : "the connection to the RPC server was lost");
    }
    std::fprintf(stderr, "%s\n", message);
}

void enter(call & cl, const int32_t * eps, int32_t n_eps, double timeout_s, bool opens) {
    guard_state & s = S();
    cl.opens = opens;
    if (eps != nullptr && n_eps > 0) {
        cl.eps.assign(eps, eps + n_eps);
    }
    if (timeout_s > 0) {
        cl.has_deadline = true;
        cl.deadline = clock_type::now() + std::chrono::duration_cast<clock_type::duration>(
                                              std::chrono::duration<double>(timeout_s));
    }
    std::lock_guard<std::mutex> lock(s.mu);
    s.calls.push_back(&cl);
    if (cl.has_deadline) {
        start_watchdog(s);
    }
}

// The status of a finished call, given what its own catch saw.
int32_t leave(call & cl, int32_t status) {
    guard_state & s = S();
    {
        std::lock_guard<std::mutex> lock(s.mu);
        s.calls.erase(std::find(s.calls.begin(), s.calls.end(), &cl));
        if (cl.opens || cl.failed) {
            refresh(s); // sockets this call opened
        }
    }
    // llama.cpp catches exceptions in model loading and context creation itself
    if (cl.failed && (status == PYSPEC_RPC_OK || status == PYSPEC_RPC_ERROR)) {
        status = cl.refused ? PYSPEC_RPC_REFUSED : PYSPEC_RPC_LOST;
    }
    if (status == PYSPEC_RPC_LOST && cl.timed_out) {
        status = PYSPEC_RPC_TIMEOUT;
    }
    return status;
}

// Run f() as a guarded call on the endpoints `eps` (ids from pyspec_rpc_watch).
template <typename F>
int32_t guarded(const int32_t * eps, int32_t n_eps, double timeout_s, bool opens, F && f) {
    call cl;
    enter(cl, eps, n_eps, timeout_s, opens);
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

// Watch "host:port": returns its endpoint id (the same id for the same text), or PYSPEC_RPC_BAD_ARG.
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
    std::lock_guard<std::mutex> lock(s.mu);
    s.eps.push_back({endpoint, addr, 0});
    return (int32_t) s.eps.size() - 1;
}

// How often connections to endpoint `ep` were lost (a model loaded before a loss is unusable).
uint64_t pyspec_rpc_losses(int32_t ep) {
    guard_state & s = S();
    std::lock_guard<std::mutex> lock(s.mu);
    return ep >= 0 && (size_t) ep < s.eps.size() ? s.eps[ep].losses : 0;
}

// Open connections to endpoint `ep`: live ones, or (sunk) lost ones that objects still hold.
int32_t pyspec_rpc_connections(int32_t ep, bool lost) {
    guard_state & s = S();
    std::lock_guard<std::mutex> lock(s.mu);
    refresh(s);
    int32_t n = 0;
    for (const auto & c : s.conns) {
        if (c.ep == ep && (c.sink_peer >= 0) == lost && same_file(c.fd, c.dev, c.ino)) {
            n++;
        }
    }
    return n;
}

// Look for connections of these endpoints whose server is gone and sink them; the number sunk.
int32_t pyspec_rpc_check(const int32_t * eps, int32_t n_eps) {
    guard_state & s = S();
    call cl;
    if (eps != nullptr && n_eps > 0) {
        cl.eps.assign(eps, eps + n_eps);
    }
    std::lock_guard<std::mutex> lock(s.mu);
    refresh(s);
    return sink_lost(s, &cl, false);
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
    enter(*t_region, eps, n_eps, timeout_s, false);
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

// Sink every connection to endpoint `ep` on purpose (its server is being stopped): the
// objects that used it are lost, and free without reaching it. The number sunk.
int32_t pyspec_rpc_retire(int32_t ep) {
    guard_state & s = S();
    call cl;
    cl.eps.push_back(ep);
    std::lock_guard<std::mutex> lock(s.mu);
    refresh(s);
    return sink_lost(s, &cl, true);
}

// ggml_backend_rpc_add_server, found through the registry (the RPC backend may be a
// dynamically loaded module), guarded: its HELLO exchange aborts on a bad answer.
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
    ggml_backend_reg_t reg = nullptr;
    *status = guarded(&ep, 1, timeout_s, true, [&] { reg = add_server(endpoint); });
    if (*status == PYSPEC_RPC_OK && reg == nullptr) {
        *status = PYSPEC_RPC_REFUSED;
    }
    return *status == PYSPEC_RPC_OK ? reg : nullptr;
}

int32_t pyspec_rpc_dev_memory(ggml_backend_dev_t dev, size_t * free, size_t * total,
                              const int32_t * eps, int32_t n_eps, double timeout_s) {
    *free = *total = 0;
    return guarded(eps, n_eps, timeout_s, true, [&] { ggml_backend_dev_memory(dev, free, total); });
}

int32_t pyspec_rpc_decode(struct llama_context * ctx, struct llama_batch batch,
                          const int32_t * eps, int32_t n_eps, double timeout_s, int32_t * result) {
    *result = -1;
    return guarded(eps, n_eps, timeout_s, false, [&] { *result = llama_decode(ctx, batch); });
}

int32_t pyspec_rpc_encode(struct llama_context * ctx, struct llama_batch batch,
                          const int32_t * eps, int32_t n_eps, double timeout_s, int32_t * result) {
    *result = -1;
    return guarded(eps, n_eps, timeout_s, false, [&] { *result = llama_encode(ctx, batch); });
}

int32_t pyspec_rpc_process(struct llama_context * ctx, int32_t type, struct llama_batch_ext * batch,
                           const int32_t * eps, int32_t n_eps, double timeout_s, int32_t * result) {
    *result = -1;
    return guarded(eps, n_eps, timeout_s, false,
                   [&] { *result = llama_process(ctx, (enum llama_process_type) type, batch); });
}

struct llama_model * pyspec_rpc_model_load(const char * path, struct llama_model_params params,
                                           const int32_t * eps, int32_t n_eps, double timeout_s, int32_t * status) {
    llama_model * model = nullptr;
    *status = guarded(eps, n_eps, timeout_s, true, [&] { model = llama_model_load_from_file(path, params); });
    if (*status != PYSPEC_RPC_OK && model != nullptr) {
        // cannot happen (a failed load returns NULL), but never hand out a half-loaded model
        llama_model_free(model);
        model = nullptr;
    }
    return model;
}

struct llama_context * pyspec_rpc_init_from_model(struct llama_model * model, struct llama_context_params params,
                                                  const int32_t * eps, int32_t n_eps, double timeout_s,
                                                  int32_t * status) {
    llama_context * ctx = nullptr;
    *status = guarded(eps, n_eps, timeout_s, true, [&] { ctx = llama_init_from_model(model, params); });
    if (*status != PYSPEC_RPC_OK && ctx != nullptr) {
        llama_free(ctx);
        ctx = nullptr;
    }
    return ctx;
}

} // extern "C"
