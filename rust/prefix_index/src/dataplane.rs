//! The router's data plane: the HTTP/1.1 server clients talk to (hyper) and the client that
//! forwards to workers (`upstream.rs`), on tokio, so that Python keeps only the decisions.
//!
//! For `POST /generate`, `/v1/chat/completions` and `/v1/completions` the server reads the body
//! and hands it to the Python router (`dp_begin`), which keys it, picks a worker and returns an
//! *exchange* with its first attempt: an object that says where to send the request (`next`),
//! hears how each attempt went (`failed`, `whole`, `streaming`, `end`, and `record`) and keeps
//! the accounting. The bytes themselves, the waiting, the retries' backoff and the streaming
//! back stay here. In PD mode the exchange is pinned to the decode worker and comes with the
//! prefill's *leg* (`prefill`): the same body, bootstrap fields added, goes to both at once.
//! Every other route (health, metrics, worker management) is passed to the Python application
//! on a private loopback port.
//!
//! Python runs under the GIL on the data plane's threads; the router guards its state with its
//! own lock. An exchange whose client goes away while an attempt is open (from the moment its
//! decision is taken) is ended (`end("client_gone")`) when it is dropped, so no accounting
//! leaks.
//!
//! Decisions are taken in turns (`decide_loop`): the requests read since the last turn enter
//! Python together, whose code then runs warm after the first.
//!
//! The answers themselves are booked without entering Python: `whole`, `streaming` and a
//! stream's `end` go into a `Ledger` with the time they happened, and the router applies them
//! (`Router.settle`, which takes them with `DataPlane.booked()`) before its next decision, when
//! it reports its state, or as soon as the answer is out when no request waits (`settle_loop`).
//! A request then enters Python once, for its decision, and the answer leaves without waiting
//! for the booking.

// A failed step ends a request with the response to send (`Err(Response)`): large, and rare.
#![allow(clippy::result_large_err)]

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Body as _;
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::copy;
use crate::python::{self, KeyedBody};
use crate::request::{self, Api};
use crate::upstream::{AnswerBody, Upstream};
use pyo3::types::PyList;
use tokio::sync::{oneshot, watch, Notify};

type Body = BoxBody<Bytes, hyper::Error>;

const GENERATION: [&str; 3] = ["/generate", "/v1/chat/completions", "/v1/completions"];
/// Headers that describe one hop, not the message: never passed on.
const HOP: [&str; 6] = [
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "proxy-connection",
];

/// A Python object held by more than one owner without taking the GIL to share it (the last to
/// let go without the GIL leaves the reference count to pyo3, for the next holder of the GIL).
type Shared = Arc<Py<PyAny>>;

/// A booking step the router has yet to apply (`Router.settle`).
struct Step {
    ex: Shared,
    kind: Kind,
    /// When it happened, on Python's `time.perf_counter` clock.
    at: f64,
}

enum Kind {
    /// `whole(status, record)` or `streaming(status, record)`.
    Answer {
        streaming: bool,
        status: u16,
        record: bool,
    },
    /// `end(outcome, events, span_s)`, for an outcome whose end returns nothing to send.
    End {
        outcome: &'static str,
        events: usize,
        span: f64,
    },
}

/// The booking steps taken since the router last settled, in the order they happened.
#[derive(Default)]
struct Ledger {
    steps: Mutex<Vec<Step>>,
    /// Told when a step goes into an empty ledger (`settle_loop`).
    queued: Notify,
}

impl Ledger {
    fn push(&self, ex: Shared, kind: Kind, at: f64) {
        let mut steps = self.steps.lock().expect("ledger");
        steps.push(Step { ex, kind, at });
        if steps.len() == 1 {
            self.queued.notify_one();
        }
    }

    fn is_empty(&self) -> bool {
        self.steps.lock().expect("ledger").is_empty()
    }
}

/// How long a booking step may wait in the ledger, while requests wait for a decision that
/// will settle it, before the data plane has the router settle anyway.
const SETTLE_AFTER: Duration = Duration::from_millis(5);

/// Has the router settle the ledger once it is no longer empty: at once (after a yield, so the
/// answer that was booked goes out first) when no request waits for a decision, which takes
/// the booking off the next request's path; otherwise the decision's turn settles it, and this
/// settles what is left `SETTLE_AFTER` later.
async fn settle_loop(plane: Arc<Plane>) {
    loop {
        plane.ledger.queued.notified().await;
        tokio::task::yield_now().await;
        if plane.decisions.any_waiting() {
            tokio::time::sleep(SETTLE_AFTER).await;
        }
        if !plane.ledger.is_empty() {
            settle(&plane);
        }
    }
}

/// How often idle connections to workers are looked over (`Upstream::sweep`).
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// Closes idle connections to workers that the workers have closed (their keep-alive timeout:
/// 5 s for SGLang's server) or that have idled too long.
async fn sweep_loop(plane: Arc<Plane>) {
    let mut every = tokio::time::interval(SWEEP_EVERY);
    loop {
        every.tick().await;
        plane.upstream.sweep();
    }
}

/// `router.settle()`, from a data plane thread.
fn settle(plane: &Plane) {
    Python::attach(|py| {
        if let Err(e) = plane.router.bind(py).call_method0("settle") {
            e.print(py);
        }
    })
}

impl Plane {
    /// A booking step, now.
    fn book(&self, ex: Shared, kind: Kind) {
        let (base, secs) = self.clock;
        self.ledger
            .push(ex, kind, secs + base.elapsed().as_secs_f64());
    }
}

struct Plane {
    router: Py<PyAny>,
    /// Client connections still open (shared with `Running`).
    connections: Arc<AtomicUsize>,
    decisions: Decisions,
    ledger: Arc<Ledger>,
    /// One moment on both clocks, taken at `start`: `Instant`s to `perf_counter` seconds.
    clock: (Instant, f64),
    /// Base URL of the Python application that serves every other route.
    internal: String,
    /// Towards the Python application (`to_internal`).
    client: Client<HttpConnector, Full<Bytes>>,
    /// Towards workers.
    upstream: Upstream,
    max_payload: usize,
    /// The longest wait for a worker's next bytes (the head, or the next chunk).
    read_timeout: Duration,
    events: memchr::memmem::Finder<'static>,
    /// Block sizes to key generation bodies with, text bytes and tokens (`keying`); None: the
    /// router keys them itself.
    keying: Option<(usize, usize)>,
}

fn full(data: impl Into<Bytes>) -> Body {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

fn respond(status: u16, headers: &[(String, String)], body: Body) -> Response<Body> {
    let mut resp = Response::new(body);
    *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    let h = resp.headers_mut();
    for (k, v) in headers {
        if let (Ok(k), Ok(v)) = (HeaderName::try_from(k.as_str()), HeaderValue::try_from(v)) {
            h.append(k, v);
        }
    }
    resp
}

fn json_response(status: u16, body: Vec<u8>) -> Response<Body> {
    let mut resp = respond(status, &[], full(body));
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// An error the data plane answers itself, in the router's JSON shape
/// (`{"error": {"message", "type", "code"}}`, as `smetric.router.app.error_body` writes it).
fn error_response(status: u16, kind: &str, message: &str) -> Response<Body> {
    let mut quoted = String::with_capacity(message.len() + 2);
    quoted.push('"');
    for c in message.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            c if (c as u32) < 0x20 => quoted.push_str(&format!("\\u{:04x}", c as u32)),
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    let body =
        format!("{{\"error\":{{\"message\":{quoted},\"type\":\"{kind}\",\"code\":{status}}}}}");
    json_response(status, body.into_bytes())
}

/// The router failed (a Python exception): the traceback goes to stderr, the client gets a 500.
fn router_error(py: Python<'_>, e: PyErr) -> Response<Body> {
    e.print(py);
    error_response(500, "ServerError", &format!("router error: {e}"))
}

/// The response body of a stream: it reads the worker's stream itself, as hyper asks for more,
/// counts its SSE events for the TPOT correction, and ends the exchange with how it went, before
/// the client sees the stream's end. Dropped before that (the client went away), it ends the
/// exchange as `client_gone` and, dropping the worker's body unread, closes that connection so
/// the worker stops generating.
///
/// What has reached the router goes out together: the worker's body gives all it has at each
/// poll (`upstream.rs`), and this body answers with all it holds once the worker's has nothing
/// more; the head takes what came with the first chunk along (`gather`), so an answer that
/// reached the router whole leaves in one write. Nothing waits for bytes still on the wire, so
/// each chunk still leaves as soon as it arrives; what is saved is a write (a system call and a
/// TCP segment) per chunk.
struct Relay {
    plane: Arc<Plane>,
    /// The exchange until its `end` is called.
    ex: Option<Shared>,
    /// The worker's stream until it ends or breaks.
    upstream: Option<AnswerBody>,
    held: Vec<Bytes>,
    /// When the worker's silence counts as broken (reset at each chunk).
    deadline: Pin<Box<tokio::time::Sleep>>,
    events: usize,
    t_first: Instant,
    t_last: Instant,
}

impl Relay {
    fn new(plane: Arc<Plane>, ex: Shared, upstream: AnswerBody, first: Bytes) -> Self {
        let now = Instant::now();
        let deadline = Box::pin(tokio::time::sleep(plane.read_timeout));
        let mut relay = Relay {
            plane,
            ex: Some(ex),
            upstream: Some(upstream),
            held: Vec::new(),
            deadline,
            events: 0,
            t_first: now,
            t_last: now,
        };
        relay.hold(first);
        relay
    }

    fn hold(&mut self, data: Bytes) {
        let n = self.plane.events.find_iter(&data).count();
        if n > 0 {
            self.t_last = Instant::now();
            if self.events == 0 {
                self.t_first = self.t_last;
            }
            self.events += n;
        }
        self.held.push(data);
    }

    /// The worker's stream is over (`ok`, `client_gone`, or `broke:<why>`): the exchange ends,
    /// in the ledger, except a broken stream's: the router settles and ends it at once, for the
    /// closing error event it gets.
    fn finish(&mut self, outcome: &str) {
        self.upstream = None;
        if let Some(ex) = self.ex.take() {
            let span = self.t_last.duration_since(self.t_first).as_secs_f64();
            if let Some(outcome) = ["ok", "client_gone"].into_iter().find(|o| *o == outcome) {
                let events = self.events;
                let kind = Kind::End {
                    outcome,
                    events,
                    span,
                };
                self.plane.book(ex, kind);
                return;
            }
            let tail: Vec<u8> = Python::attach(|py| {
                settle(&self.plane); // the stream's earlier steps first
                match ex
                    .bind(py)
                    .call_method1("end", (outcome, self.events, span))
                {
                    Ok(t) => t.extract().unwrap_or_default(),
                    Err(e) => {
                        e.print(py);
                        Vec::new()
                    }
                }
            });
            if !tail.is_empty() {
                self.held.push(Bytes::from(tail));
            }
        }
    }

    /// Before the head goes out: takes what else of the worker's answer has already arrived.
    async fn gather(&mut self) {
        std::future::poll_fn(|cx| {
            let _ = self.pull(cx); // what has not arrived yet goes later, with the rest
            Poll::Ready(())
        })
        .await
    }

    /// Takes what the worker's body has, until it has nothing more now (`Pending`, with the
    /// task woken when it has), ends, or breaks; or until enough is held to send.
    fn pull(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            let held: usize = self.held.iter().map(Bytes::len).sum();
            let Some(upstream) = self.upstream.as_mut().filter(|_| held < RELAY_FLUSH_BYTES) else {
                return Poll::Ready(());
            };
            match upstream.poll_data(cx, &self.plane.upstream) {
                Poll::Ready(Some(Ok(data))) => {
                    self.hold(data);
                    let timeout = self.plane.read_timeout;
                    self.deadline
                        .as_mut()
                        .reset(tokio::time::Instant::now() + timeout);
                }
                Poll::Ready(None) => self.finish("ok"),
                Poll::Ready(Some(Err(e))) => self.finish(&format!("broke:ClientPayloadError: {e}")),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn take_held(&mut self) -> Option<Bytes> {
        match self.held.len() {
            0 => None,
            1 => self.held.pop(),
            _ => Some(Bytes::from(
                self.held.drain(..).collect::<Vec<_>>().concat(),
            )),
        }
    }
}

/// Held data worth sending without trying for more.
const RELAY_FLUSH_BYTES: usize = 64 << 10;

impl hyper::body::Body for Relay {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        while this.pull(cx).is_pending() && this.held.is_empty() {
            if this.deadline.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.finish("broke:TimeoutError: the worker went quiet");
        }
        Poll::Ready(this.take_held().map(|b| Ok(Frame::data(b))))
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if self.ex.is_some() {
            drop(self.upstream.take()); // unread, it closes the worker's connection
            self.finish("client_gone");
        }
    }
}

/// The exchange, and whether it has an attempt open. Dropped with an attempt open (the client
/// went away, or the server stopped), it ends the attempt so the accounting is released.
struct Exchange {
    ex: Option<Py<PyAny>>,
    open: bool,
}

impl Exchange {
    fn call<A>(&self, name: &str, args: A) -> Result<Py<PyAny>, Response<Body>>
    where
        A: for<'py> pyo3::call::PyCallArgs<'py>,
    {
        let ex = self.ex.as_ref().expect("exchange already handed on");
        Python::attach(|py| {
            ex.bind(py)
                .call_method1(name, args)
                .map(Bound::unbind)
                .map_err(|e| router_error(py, e))
        })
    }

    /// The attempt failed before anything reached the client: the router books it and says
    /// how long to wait before the next (`None`: no attempt left).
    async fn failed(&mut self, reason: String) -> Result<(), Response<Body>> {
        let delay = self.call("failed", (reason,))?;
        self.open = false;
        let delay: Option<f64> = Python::attach(|py| delay.extract(py)).unwrap_or(None);
        if let Some(d) = delay.filter(|d| d.is_finite() && *d > 0.0) {
            tokio::time::sleep(Duration::from_secs_f64(d)).await;
        }
        Ok(())
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        if let (true, Some(ex)) = (self.open, self.ex.take()) {
            Python::attach(|py| {
                if let Err(e) = ex
                    .bind(py)
                    .call_method1("end", ("client_gone", 0usize, 0.0f64))
                {
                    e.print(py);
                }
            });
        }
    }
}

async fn read_body(body: Incoming, limit: usize) -> Result<Bytes, (u16, &'static str)> {
    // The declared length, to join the frames into as they come (a larger one fails below).
    let declared = body
        .size_hint()
        .exact()
        .map_or(0, |n| n as usize)
        .min(limit);
    let mut body = Limited::new(body, limit);
    // One frame is the body as it is; from the second, the frames are copied into one buffer
    // as each arrives, while the client is still sending the rest, so that only the last
    // frame's copy follows the body's end (`copy::append`: glibc's copy can be an order of
    // magnitude slower at some distances between two large buffers).
    let mut first: Option<Bytes> = None;
    let mut joined: Vec<u8> = Vec::new();
    while !body.is_end_stream() {
        let Some(frame) = body.frame().await else {
            break;
        };
        let frame = match frame {
            Ok(f) => f,
            Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
                return Err((413, "request body exceeds --max-payload-size"))
            }
            Err(_) => return Err((400, "could not read the request body")),
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        match first.take() {
            None if joined.is_empty() => first = Some(data),
            None => copy::append(&mut joined, &data),
            Some(head) => {
                joined.reserve_exact(declared.max(head.len() + data.len()));
                copy::append(&mut joined, &head);
                copy::append(&mut joined, &data);
            }
        }
    }
    Ok(match first {
        Some(whole) => whole,
        None => Bytes::from(joined),
    })
}

/// The next data of a worker's answer: `Ok(None)` at its end, `Err` when it broke or went
/// quiet for longer than the read timeout.
async fn next_data(plane: &Plane, body: &mut AnswerBody) -> Result<Option<Bytes>, String> {
    let next = std::future::poll_fn(|cx| body.poll_data(cx, &plane.upstream));
    match tokio::time::timeout(plane.read_timeout, next).await {
        Err(_) => Err("TimeoutError: the worker went quiet".into()),
        Ok(None) => Ok(None),
        Ok(Some(Err(e))) => Err(format!("ClientPayloadError: {e}")),
        Ok(Some(Ok(data))) => Ok(Some(data)),
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

async fn serve(plane: Arc<Plane>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let arrived = Instant::now();
    let generation = req.method() == Method::POST && GENERATION.contains(&req.uri().path());
    let (parts, body) = req.into_parts();
    let raw = match read_body(body, plane.max_payload).await {
        Ok(raw) => raw,
        Err((status, message)) if generation => {
            return Ok(Python::attach(|py| {
                match plane
                    .router
                    .bind(py)
                    .call_method1("dp_error", (parts.uri.path(), status, message))
                {
                    Ok(b) => json_response(status, b.extract().unwrap_or_default()),
                    Err(e) => router_error(py, e),
                }
            }))
        }
        Err((status, message)) => return Ok(error_response(status, "BadRequestError", message)),
    };
    if !generation {
        return Ok(to_internal(&plane, parts, raw).await);
    }
    let keyed = key(&plane, parts.uri.path(), &raw);
    // The router reads the request, decides, and names the first worker (`decide_loop`).
    let (reply, decided) = oneshot::channel();
    plane.decisions.push(Waiting {
        parts,
        raw: raw.clone(),
        keyed,
        arrived,
        reply,
    });
    let Ok((parts, begun)) = decided.await else {
        return Ok(error_response(503, "ServerError", "the router is stopping"));
    };
    let (mut ex, target, stream, leg) = match begun {
        Err(e) => return Ok(Python::attach(|py| router_error(py, e))),
        Ok(Begun::Respond(resp)) => return Ok(resp),
        Ok(Begun::Exchange(ex, target, stream, leg)) => (ex, target, stream, leg),
    };
    let path = parts.uri.path();
    Ok(match leg {
        None => forward(&plane, path, raw, &mut ex, target, stream)
            .await
            .unwrap_or_else(|resp| resp),
        Some(pd) => forward_pd(&plane, path, raw, ex, target, stream, pd).await,
    })
}

/// PD's prefill request (`PrefillLeg` in the router): its worker, the bootstrap fields to add
/// to the body, and the leg itself, to report to. Dropped before it is over (the server
/// stopped, or the body could not be sent), it reports that it was given up, so the prefill
/// worker's accounting is released.
struct Leg {
    url: String,
    fragment: Vec<u8>,
    headers: Headers,
    leg: Option<Py<PyAny>>,
}

impl Leg {
    /// `leg.done(status)`: 0 when no answer came, negative when given up; whether it succeeded.
    fn done(&mut self, status: i32) -> bool {
        let Some(leg) = self.leg.take() else {
            return false;
        };
        Python::attach(|py| match leg.bind(py).call_method1("done", (status,)) {
            Ok(ok) => ok.extract().unwrap_or(false),
            Err(e) => {
                e.print(py);
                false
            }
        })
    }
}

impl Drop for Leg {
    fn drop(&mut self) {
        if self.leg.is_some() {
            self.done(-1);
        }
    }
}

/// A PD request: the prefill's leg is sent on a task of its own (`prefill`) while the decode's
/// exchange is forwarded as any other. If the prefill fails before the decode has answered,
/// the decode worker would wait for KV that never comes: its request is dropped (its
/// exchange ends as the client's going would end it, no failure held against the worker) and
/// the client gets the leg's `failure`: the prefill worker's 4xx as it came, else a 502. Once
/// the decode has answered, the answer stands.
async fn forward_pd(
    plane: &Arc<Plane>,
    path: &str,
    raw: Bytes,
    mut ex: Exchange,
    target: Next,
    stream: bool,
    (mut leg, failure): (Leg, Py<PyAny>),
) -> Response<Body> {
    let Some(body) = request::inject_members(&raw, &leg.fragment).map(Bytes::from) else {
        // Not reached: a request the router took is a JSON object.
        leg.done(-1);
        return error_response(400, "BadRequestError", "request body must be a JSON object");
    };
    let (told, outcome) = oneshot::channel();
    tokio::spawn(prefill(
        plane.clone(),
        path.to_owned(),
        body.clone(),
        leg,
        told,
    ));
    let prefill_failed = async {
        match outcome.await {
            Ok(Some(failed)) => failed,
            _ => std::future::pending().await,
        }
    };
    tokio::select! {
        answer = forward(plane, path, body, &mut ex, target, stream) => {
            answer.unwrap_or_else(|resp| resp)
        }
        (status, answer) = prefill_failed => leg_failure(failure, status, answer),
    }
}

/// `leg.failure(status, body)`: the client's answer when the prefill failed first.
fn leg_failure(leg: Py<PyAny>, status: i32, answer: Vec<u8>) -> Response<Body> {
    Python::attach(|py| {
        let answer = PyBytes::new(py, &answer);
        let out = leg.bind(py).call_method1("failure", (status, answer));
        match out.and_then(|o| o.extract::<(u16, Vec<u8>)>()) {
            Ok((status, body)) => json_response(status, body),
            Err(e) => router_error(py, e),
        }
    })
}

/// Sends the prefill's leg and reads its answer to the end (keeping a failed one's), each wait
/// bounded by the read timeout; then reports it (`Leg::done`, aside for a large prompt: a
/// success teaches the index the prompt) and tells `forward_pd` how it went: None if it
/// succeeded, else its status (0: no answer) and answer.
async fn prefill(
    plane: Arc<Plane>,
    path: String,
    body: Bytes,
    mut leg: Leg,
    told: oneshot::Sender<Option<(i32, Vec<u8>)>>,
) {
    let post = plane.upstream.post(&leg.url, &path, &leg.headers, &body);
    let mut answer = Vec::new();
    let status = match tokio::time::timeout(plane.read_timeout, post).await {
        Ok(Ok(head)) => {
            let mut rest = head.body;
            loop {
                match next_data(&plane, &mut rest).await {
                    Ok(Some(data)) if head.status != 200 => answer.extend_from_slice(&data),
                    Ok(Some(_)) => {}
                    Ok(None) => break i32::from(head.status),
                    Err(_) => break 0,
                }
            }
        }
        _ => 0,
    };
    let ok = if body.len() >= RECORD_ASIDE_BYTES {
        tokio::task::spawn_blocking(move || leg.done(status))
            .await
            .unwrap_or(false)
    } else {
        leg.done(status)
    };
    let _ = told.send(if ok { None } else { Some((status, answer)) });
}

/// A generation body keyed here, on the connection's thread, outside the GIL and before the
/// decision's turn (`key_request_body`'s work): the router then takes the keys instead of a
/// copy of the body. None where the fast path leaves the body to the router's reference path,
/// or the data plane was started without `keying`.
fn key(plane: &Plane, path: &str, raw: &[u8]) -> Option<KeyedBody> {
    let (text_block_bytes, token_block_tokens) = plane.keying?;
    let api = match path {
        "/generate" => Api::Generate,
        "/v1/chat/completions" => Api::Chat,
        "/v1/completions" => Api::Completions,
        _ => return None,
    };
    python::key_body(api, raw, text_block_bytes, token_block_tokens)
}

/// A generation request read whole, waiting for the router's decision.
struct Waiting {
    parts: hyper::http::request::Parts,
    raw: Bytes,
    keyed: Option<KeyedBody>,
    arrived: Instant,
    /// The request's head back, with what `dp_begin` made of it.
    reply: oneshot::Sender<(hyper::http::request::Parts, PyResult<Begun>)>,
}

/// The requests waiting for their decision, in the order they came.
struct Decisions {
    waiting: Mutex<Vec<Waiting>>,
    /// Told when a request comes to an empty queue (`decide_loop`).
    queued: Notify,
    /// Turns taken, and the requests decided in them (`DataPlane.turns`).
    counts: Arc<TurnCounts>,
}

#[derive(Default)]
struct TurnCounts {
    turns: AtomicU64,
    requests: AtomicU64,
}

impl Decisions {
    fn any_waiting(&self) -> bool {
        !self.waiting.lock().expect("decisions").is_empty()
    }

    fn push(&self, w: Waiting) {
        let mut waiting = self.waiting.lock().expect("decisions");
        waiting.push(w);
        if waiting.len() == 1 {
            self.queued.notify_one();
        }
    }
}

/// Decides the waiting requests in turns: each turn first lets every connection that has a
/// request ready read it (`yield_now` runs after the tasks already woken and the next poll for
/// I/O), then enters Python once for them all. Python's code and data are cold after the
/// sockets and hyper have run (measured: one request's router code takes about twice as long
/// then as in a loop), so the requests after the first in a turn cost less.
async fn decide_loop(plane: Arc<Plane>) {
    loop {
        plane.decisions.queued.notified().await;
        tokio::task::yield_now().await;
        let mut turn = std::mem::take(&mut *plane.decisions.waiting.lock().expect("decisions"));
        turn.retain(|w| !w.reply.is_closed()); // a client that has gone: nothing to decide
        if turn.is_empty() {
            continue;
        }
        let counts = &plane.decisions.counts;
        counts.turns.fetch_add(1, Ordering::Relaxed);
        counts
            .requests
            .fetch_add(turn.len() as u64, Ordering::Relaxed);
        Python::attach(|py| {
            for w in turn {
                let begun = begin(py, &plane, &w.parts, &w.raw, w.keyed, w.arrived);
                // The client may have gone since: what comes back unsent is dropped here, and
                // an exchange dropped with its attempt open ends it (`Exchange`'s `Drop`).
                let _ = w.reply.send((w.parts, begun));
            }
        });
    }
}

/// `router.dp_begin(path, keyed, body, headers, read_s)`: the exchange with its first attempt
/// (and in PD mode the prefill's leg), or an answer to give at once. The body goes as a Python
/// `bytes` only where it was not keyed here (`key`).
fn begin(
    py: Python<'_>,
    plane: &Plane,
    parts: &hyper::http::request::Parts,
    raw: &Bytes,
    keyed: Option<KeyedBody>,
    arrived: Instant,
) -> PyResult<Begun> {
    let headers = PyDict::new(py);
    for (k, v) in parts.headers.iter() {
        if let Ok(v) = v.to_str() {
            headers.set_item(k.as_str(), v)?;
        }
    }
    let read_s = arrived.elapsed().as_secs_f64();
    let body = match keyed {
        Some(_) => None,
        None => Some(py_bytes(py, raw)?),
    };
    let out = plane
        .router
        .bind(py)
        .call_method1("dp_begin", (parts.uri.path(), keyed, body, headers, read_s))?;
    let out = out.cast::<PyTuple>()?;
    if out.len() == 2 {
        let (status, body): (u16, Vec<u8>) = out.extract()?;
        return Ok(Begun::Respond(json_response(status, body)));
    }
    // Each taken into its guard first, which ends it if dropped (whatever fails after, or when
    // the client has gone before the decision reaches it; `end` on an exchange with no attempt
    // open does nothing).
    let mut ex = Exchange {
        open: true,
        ex: Some(out.get_item(0)?.unbind()),
    };
    let leg = if out.len() == 4 {
        let handle = out.get_item(3)?;
        let mut leg = Leg {
            url: String::new(),
            fragment: Vec::new(),
            headers: Vec::new(),
            leg: Some(handle.clone().unbind()),
        };
        leg.url = handle.getattr("url")?.extract()?;
        leg.fragment = handle.getattr("fragment")?.extract()?;
        leg.headers = handle.getattr("headers")?.extract()?;
        Some((leg, handle.unbind()))
    } else {
        None
    };
    let target: Next = out.get_item(1)?.extract()?;
    ex.open = target.is_some();
    let stream: bool = out.get_item(2)?.extract()?;
    Ok(Begun::Exchange(ex, target, stream, leg))
}

/// The body as the Python `bytes` the router reads (`copy::copy`: see `read_body`).
fn py_bytes<'py>(py: Python<'py>, raw: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    PyBytes::new_with(py, raw.len(), |buf| {
        copy::copy(buf, raw);
        Ok(())
    })
}

/// Header names and values.
type Headers = Vec<(String, String)>;
/// The worker for the next attempt (its URL, the headers to send it, and the headers for the
/// client), or none left.
type Next = Option<(String, Headers, Headers)>;

enum Begun {
    Respond(Response<Body>),
    /// The exchange, its first attempt, whether the client asked for a stream, and in PD mode
    /// the prefill's leg (and the leg again, for its `failure`).
    Exchange(Exchange, Next, bool, Option<(Leg, Py<PyAny>)>),
}

fn extract<T>(out: Result<Py<PyAny>, Response<Body>>) -> Result<T, Response<Body>>
where
    T: for<'py> pyo3::conversion::FromPyObjectOwned<'py>,
{
    let out = out?;
    Python::attach(|py| {
        out.bind(py)
            .extract::<T>()
            .map_err(|e| router_error(py, e.into()))
    })
}

/// Tries workers as the exchange names them until one answers, then answers the client: whole
/// (not streaming, or an error status), or as a stream read by a `Relay`.
async fn forward(
    plane: &Arc<Plane>,
    path: &str,
    raw: Bytes,
    ex: &mut Exchange,
    target: Next,
    stream: bool,
) -> Result<Response<Body>, Response<Body>> {
    let mut first_target = Some(target); // named by `dp_begin`; each retry asks `next`
    loop {
        let target = match first_target.take() {
            Some(t) => t,
            None => extract(ex.call("next", ()))?,
        };
        ex.open = target.is_some();
        let Some((url, headers, mut out_headers)) = target else {
            let (status, body): (u16, Vec<u8>) = extract(ex.call("refusal", ()))?;
            return Ok(json_response(status, body));
        };
        let post = plane.upstream.post(&url, path, &headers, &raw);
        let resp = match tokio::time::timeout(plane.read_timeout, post).await {
            Err(_) => Err("TimeoutError: no answer from the worker in time".to_string()),
            Ok(r) => r,
        };
        let resp = match resp {
            Ok(r) => r,
            Err(reason) => {
                ex.failed(reason).await?;
                continue;
            }
        };
        let status = resp.status;
        if status >= 500 {
            ex.failed(format!("worker answered {status}")).await?;
            continue;
        }
        out_headers.push((
            "content-type".to_owned(),
            resp.content_type
                .unwrap_or_else(|| "application/json".into()),
        ));
        if let Some(cenc) = resp.content_encoding {
            out_headers.push(("content-encoding".to_owned(), cenc));
        }
        let mut body = resp.body;
        let mut data = Vec::new();
        if stream && status == 200 {
            // Wait for the first bytes before answering: until then a failed worker can be
            // retried. An empty stream is answered whole, below.
            match next_data(plane, &mut body).await {
                Err(reason) => {
                    ex.failed(reason).await?;
                    continue;
                }
                Ok(None) => {}
                Ok(Some(first)) => {
                    // Booked (queued in the ledger) before the client sees it; the stream's end
                    // is the `Relay`'s to report.
                    let handed = book(plane, ex, true, status, raw.len());
                    let mut relay = Relay::new(plane.clone(), handed, body, first);
                    relay.gather().await;
                    return Ok(respond(status, &out_headers, relay.boxed()));
                }
            }
        } else {
            let broke = loop {
                match next_data(plane, &mut body).await {
                    Ok(Some(chunk)) => data.extend_from_slice(&chunk),
                    Ok(None) => break None,
                    Err(reason) => break Some(reason),
                }
            };
            if let Some(reason) = broke {
                ex.failed(reason).await?;
                continue;
            }
        }
        book(plane, ex, false, status, raw.len());
        return Ok(respond(status, &out_headers, full(data)));
    }
}

/// Prompts below this size (bytes) are recorded in the index with the booking of the answer
/// (`whole` or `streaming` with `record=True`, when the router settles): no entry into Python of
/// their own. Larger ones are recorded by a task of their own once the answer is on its way.
const RECORD_INLINE_BYTES: usize = 16 << 10;

/// Prompts from this size (bytes) are recorded in the index on a blocking thread: the insert
/// then runs beside the next requests (it releases the GIL for large prompts) instead of
/// holding up the data plane's thread.
const RECORD_ASIDE_BYTES: usize = 64 << 10;

/// Books the answer (`whole` or `streaming`, in the ledger: the attempt is no longer the data
/// plane's to end) and hands the exchange over; the prompt is recorded with that step when
/// small, on its own once the answer is on its way otherwise.
fn book(plane: &Plane, ex: &mut Exchange, streaming: bool, status: u16, body_len: usize) -> Shared {
    let record = body_len < RECORD_INLINE_BYTES;
    ex.open = false;
    let handed = Arc::new(ex.ex.take().expect("exchange present"));
    let kind = Kind::Answer {
        streaming,
        status,
        record,
    };
    plane.book(handed.clone(), kind);
    if !record {
        spawn_record(handed.clone(), body_len);
    }
    handed
}

/// `ex.record()`, the index learning the prompt (the one step whose cost grows with it), once
/// the answer is on its way: a task spawned now runs after the current one has handed its
/// response to hyper. The record settles first, if the answer's booking is still queued.
fn spawn_record(ex: Shared, body_len: usize) {
    let call = move || {
        Python::attach(|py| {
            if let Err(e) = ex.bind(py).call_method0("record") {
                e.print(py);
            }
        })
    };
    if body_len >= RECORD_ASIDE_BYTES {
        tokio::task::spawn_blocking(call);
    } else {
        tokio::spawn(async move { call() });
    }
}

/// Every route but generation: to the Python application, and its answer back as it comes.
async fn to_internal(
    plane: &Plane,
    parts: hyper::http::request::Parts,
    raw: Bytes,
) -> Response<Body> {
    let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut req = Request::new(Full::new(raw));
    *req.method_mut() = parts.method;
    *req.uri_mut() = match format!("{}{pq}", plane.internal).parse() {
        Ok(u) => u,
        Err(_) => return error_response(400, "BadRequestError", "bad request target"),
    };
    for (k, v) in parts.headers.iter() {
        if !HOP.contains(&k.as_str()) && k != "host" && k != "content-length" {
            req.headers_mut().append(k, v.clone());
        }
    }
    match plane.client.request(req).await {
        Ok(resp) => {
            let (mut p, b) = resp.into_parts();
            for h in HOP {
                p.headers.remove(h);
            }
            Response::from_parts(p, b.boxed())
        }
        Err(e) => {
            let message = format!("router's control plane unreachable: {}", error_chain(&e));
            error_response(502, "ServerError", &message)
        }
    }
}

async fn accept_loop(
    listener: std::net::TcpListener,
    plane: Arc<Plane>,
    mut stop: watch::Receiver<bool>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("smetric data plane: cannot listen: {e}");
            return;
        }
    };
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let plane = plane.clone();
                    let mut stop = stop.clone();
                    let open = Open::new(&plane.connections);
                    tokio::spawn(async move {
                        let _open = open;
                        let svc = service_fn(move |req| serve(plane.clone(), req));
                        let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), svc);
                        tokio::pin!(conn);
                        tokio::select! {
                            _ = conn.as_mut() => return,
                            _ = stop.changed() => {}
                        }
                        // Stopping: an idle connection closes now, a busy one once its answer
                        // (a stream too) has gone out.
                        conn.as_mut().graceful_shutdown();
                        let _ = conn.await;
                    });
                }
                // Out of file descriptors, most likely: let some connections close.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
        }
    }
}

thread_local! {
    static THREAD_STATE: std::cell::Cell<Option<pyo3::ffi::PyGILState_STATE>> =
        const { std::cell::Cell::new(None) };
}

/// Gives the thread a Python thread state for its whole life. Without one, every
/// `Python::attach` would create a thread state and destroy it again (an allocation and a fresh
/// mapping for its frame stack, each time): it now only takes and releases the GIL.
fn keep_thread_state() {
    // SAFETY: the interpreter is running (the data plane is started from Python). The state is
    // taken with the GIL, then the GIL alone is released, leaving the thread state registered.
    unsafe {
        let state = pyo3::ffi::PyGILState_Ensure();
        pyo3::ffi::PyEval_SaveThread();
        THREAD_STATE.with(|s| s.set(Some(state)));
    }
}

fn drop_thread_state() {
    if let Some(state) = THREAD_STATE.with(|s| s.take()) {
        // SAFETY: pairs with `keep_thread_state` on this thread: take the GIL back with the kept
        // thread state, then release both. Skipped while the interpreter is finalizing.
        unsafe {
            if pyo3::ffi::Py_IsInitialized() != 0 {
                pyo3::ffi::PyEval_RestoreThread(pyo3::ffi::PyGILState_GetThisThreadState());
                pyo3::ffi::PyGILState_Release(state);
            }
        }
    }
}

struct Running {
    runtime: tokio::runtime::Runtime,
    stop: watch::Sender<bool>,
    port: u16,
    /// Client connections still open.
    connections: Arc<AtomicUsize>,
}

/// One client connection, counted while it is open (`Running::connections`).
struct Open(Arc<AtomicUsize>);

impl Open {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Open(count.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The data plane: `DataPlane(router, internal_url, max_payload_size, read_timeout_s,
/// connect_timeout_s, threads, keying)`, then `start(host, port)` (returns the port it listens
/// on) and `stop()`. `keying`, `(text_block_bytes, token_block_tokens)`, has the data plane key
/// generation bodies itself (`key`); without it the router gets each body to key.
#[pyclass(module = "smetric._prefix_index", name = "DataPlane")]
pub struct PyDataPlane {
    router: Py<PyAny>,
    internal: String,
    max_payload: usize,
    read_timeout: Duration,
    connect_timeout: Duration,
    threads: usize,
    keying: Option<(usize, usize)>,
    ledger: Arc<Ledger>,
    turns: Arc<TurnCounts>,
    running: Mutex<Option<Running>>,
}

fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    if !(value.is_finite() && value > 0.0) {
        return Err(PyValueError::new_err(format!(
            "{name} must be a positive number of seconds, got {value}"
        )));
    }
    Ok(Duration::from_secs_f64(value.min(1e9)))
}

#[pymethods]
impl PyDataPlane {
    #[new]
    #[pyo3(signature = (router, internal_url, max_payload_size, read_timeout_s, connect_timeout_s, threads=1, keying=None))]
    fn new(
        router: Py<PyAny>,
        internal_url: String,
        max_payload_size: usize,
        read_timeout_s: f64,
        connect_timeout_s: f64,
        threads: usize,
        keying: Option<(i64, i64)>,
    ) -> PyResult<Self> {
        if threads == 0 {
            return Err(PyValueError::new_err("threads must be at least 1"));
        }
        let keying = match keying {
            Some((text, tokens)) => Some((
                python::positive("text_block_bytes", text)?,
                python::positive("token_block_tokens", tokens)?,
            )),
            None => None,
        };
        Ok(Self {
            router,
            internal: internal_url.trim_end_matches('/').to_owned(),
            max_payload: max_payload_size,
            read_timeout: seconds("read_timeout_s", read_timeout_s)?,
            connect_timeout: seconds("connect_timeout_s", connect_timeout_s)?,
            threads,
            keying,
            ledger: Arc::default(),
            turns: Arc::new(TurnCounts::default()),
            running: Mutex::new(None),
        })
    }

    /// Listens on `host:port` (0: any free port) and serves until `stop()`; returns the port.
    fn start(&self, py: Python<'_>, host: &str, port: u16) -> PyResult<u16> {
        let mut running = self.running.lock().expect("data plane lock");
        if running.is_some() {
            return Err(PyRuntimeError::new_err("the data plane is already running"));
        }
        let listener = std::net::TcpListener::bind((host, port))
            .map_err(|e| PyOSError::new_err(format!("cannot listen on {host}:{port}: {e}")))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(self.threads)
            .thread_name("smetric-data-plane")
            .on_thread_start(keep_thread_state)
            .on_thread_stop(drop_thread_state)
            .enable_all()
            .build()?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(self.connect_timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .build(connector);
        let perf_counter: f64 = py.import("time")?.call_method0("perf_counter")?.extract()?;
        let connections = Arc::new(AtomicUsize::new(0));
        let plane = Arc::new(Plane {
            router: self.router.clone_ref(py),
            connections: connections.clone(),
            decisions: Decisions {
                waiting: Mutex::new(Vec::new()),
                queued: Notify::new(),
                counts: self.turns.clone(),
            },
            ledger: self.ledger.clone(),
            clock: (Instant::now(), perf_counter),
            internal: self.internal.clone(),
            client,
            upstream: Upstream::new(self.connect_timeout),
            max_payload: self.max_payload,
            read_timeout: self.read_timeout,
            events: memchr::memmem::Finder::new(b"data: {").into_owned(),
            keying: self.keying,
        });
        let (stop, stopped) = watch::channel(false);
        // These run until the runtime stops: connections still draining need them.
        runtime.spawn(settle_loop(plane.clone()));
        runtime.spawn(sweep_loop(plane.clone()));
        runtime.spawn(decide_loop(plane.clone()));
        runtime.spawn(accept_loop(listener, plane, stopped));
        *running = Some(Running {
            runtime,
            stop,
            port,
            connections,
        });
        Ok(port)
    }

    /// Stops listening, then lets the requests in progress finish for up to `grace_s` seconds
    /// (their connections close as each answer, a stream too, has gone out; idle ones close at
    /// once), then ends every exchange still open: an answered one's end is queued in the
    /// ledger, for the router's next `settle()` (`Listening.close` calls it); one not yet
    /// answered is ended at once. Returns the connections that were still open at the end.
    #[pyo3(signature = (grace_s=0.0))]
    fn stop(&self, py: Python<'_>, grace_s: f64) -> PyResult<usize> {
        if !(grace_s.is_finite() && grace_s >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "grace_s must be a non-negative number of seconds, got {grace_s}"
            )));
        }
        let running = self.running.lock().expect("data plane lock").take();
        let Some(r) = running else { return Ok(0) };
        let _ = r.stop.send(true);
        let left = py.detach(|| {
            let deadline = Instant::now() + Duration::from_secs_f64(grace_s.min(1e6));
            while r.connections.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            let left = r.connections.load(Ordering::Relaxed);
            r.runtime.shutdown_timeout(Duration::from_secs(5));
            left
        });
        Ok(left)
    }

    /// The booking steps queued since the last call, in order, as `Router.settle` applies them:
    /// `(exchange, "whole" | "streaming", status, record, None, at)` or
    /// `(exchange, "end", outcome, events, span_s, at)`, `at` on `time.perf_counter`'s clock;
    /// None when there are none.
    fn booked<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        let steps = std::mem::take(&mut *self.ledger.steps.lock().expect("ledger"));
        if steps.is_empty() {
            return Ok(None);
        }
        let list = PyList::empty(py);
        for step in steps {
            let ex = step.ex.clone_ref(py);
            match step.kind {
                Kind::Answer {
                    streaming,
                    status,
                    record,
                } => {
                    let name = if streaming { "streaming" } else { "whole" };
                    list.append((ex, name, status, record, py.None(), step.at))?
                }
                Kind::End {
                    outcome,
                    events,
                    span,
                } => list.append((ex, "end", outcome, events, span, step.at))?,
            }
        }
        Ok(Some(list))
    }

    /// `(turns, requests)`: the turns in which the router took requests (`dp_begin`), and the
    /// requests taken in them, routed or refused, since the data plane was made (requests that
    /// arrive together share a turn, and one entry into Python).
    #[getter]
    fn turns(&self) -> (u64, u64) {
        let c = &self.turns;
        (
            c.turns.load(Ordering::Relaxed),
            c.requests.load(Ordering::Relaxed),
        )
    }

    #[getter]
    fn port(&self) -> Option<u16> {
        self.running
            .lock()
            .expect("data plane lock")
            .as_ref()
            .map(|r| r.port)
    }
}
