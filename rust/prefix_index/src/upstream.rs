//! The data plane's client towards workers: HTTP/1.1 `POST`s over pooled keep-alive
//! connections, read by the task that relays the answer.
//!
//! hyper's client runs each connection in a task of its own and hands a body over a channel,
//! one chunk per round trip between the two tasks: a streamed answer of six events took six
//! hand-overs even when all of it had reached the router in one read. Here the answer's body
//! owns its connection and decodes, at each poll, everything its buffer and socket hold: a
//! `Pending` then means that nothing more has arrived, so the relay never waits on a
//! hand-over and never holds a first chunk back for a next one still on the wire.
//!
//! A connection goes back to the pool only once its answer has been read to its end, with
//! nothing after it; a body dropped before that (the client went away) closes its connection,
//! which tells the worker to stop. A pooled connection the worker has closed meanwhile (its
//! keep-alive timeout) is noticed when taken, or (a close racing the request) when sending on
//! it fails, or when it closes with no byte of an answer after an idle spell of at least
//! `RESEND_AFTER_IDLE`: the request then goes once more, on a fresh connection. A connection
//! that closes unanswered sooner after its last use is a failure like any other (the worker
//! may have read the request), for the router to retry elsewhere.

use std::collections::HashMap;
use std::io::{self, IoSlice};
use std::sync::Mutex;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// How long an idle connection is kept (hyper's default pool timeout was the same).
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// A pooled connection idle this long that closes unanswered was closed by the worker as idle
/// (servers' keep-alive timeouts are seconds: uvicorn's, SGLang's server, 5 s), not after
/// reading the request: sent again, once.
const RESEND_AFTER_IDLE: Duration = Duration::from_secs(1);
/// The most an answer's head may take.
const MAX_HEAD_BYTES: usize = 64 << 10;
/// The most headers an answer's head may have.
const MAX_HEADERS: usize = 128;
/// What one read asks the socket for, at least.
const READ_BYTES: usize = 16 << 10;

/// Connections to workers, idle ones kept per `host:port`.
pub struct Upstream {
    /// Per `host:port`, the idle connections and since when each has been idle.
    idle: Mutex<HashMap<String, Vec<(TcpStream, Instant)>>>,
    connect_timeout: Duration,
}

/// A worker's answer: its status, the headers the router passes on, and its body.
pub struct Answer {
    pub status: u16,
    pub content_type: Option<String>,
    pub content_encoding: Option<String>,
    pub body: AnswerBody,
}

/// The rest of an answer, read from its connection as it is polled (`poll_data`).
pub struct AnswerBody {
    stream: Option<TcpStream>,
    /// Bytes read and not yet decoded.
    buf: BytesMut,
    framing: Framing,
    /// Whether the connection may carry another request once this body has been read.
    keep_alive: bool,
    /// Where the connection goes back to (`host:port`).
    connect: String,
}

#[derive(Debug, PartialEq)]
enum Framing {
    /// This many bytes are left.
    Length(u64),
    Chunked(Chunk),
    /// Until the worker closes the connection.
    Close,
    Done,
}

#[derive(Debug, PartialEq)]
enum Chunk {
    /// At a chunk's size line.
    Size,
    /// Inside a chunk's data, this many bytes left.
    Data(u64),
    /// After a chunk's data: its closing CRLF.
    DataEnd,
    /// After the last chunk: trailer lines, to the empty one.
    Trailer,
}

/// Why a request could not be sent or answered.
struct Failure {
    reason: String,
    /// Sending failed: the worker did not get the whole request.
    unsent: bool,
    /// The connection closed with no byte of an answer.
    unanswered: bool,
}

impl Failure {
    fn new(reason: impl Into<String>) -> Self {
        Failure {
            reason: reason.into(),
            unsent: false,
            unanswered: false,
        }
    }
}

impl Upstream {
    pub fn new(connect_timeout: Duration) -> Self {
        Upstream {
            idle: Mutex::new(HashMap::new()),
            connect_timeout,
        }
    }

    /// `POST {url}{path}` with `headers` and `body`; the answer once its head has come. A
    /// pooled connection that turns out closed is replaced once.
    pub async fn post(
        &self,
        url: &str,
        path: &str,
        headers: &[(String, String)],
        body: &[u8],
    ) -> Result<Answer, String> {
        let t = target(url)?;
        let head = request_head(&t, path, headers, body.len());
        let mut resent = false;
        loop {
            let pooled = if resent {
                None
            } else {
                self.checkout(&t.connect)
            };
            let (stream, idle) = match pooled {
                Some((s, idle)) => (s, Some(idle)),
                None => (self.connect(&t.connect).await?, None),
            };
            match exchange(stream, &head, body).await {
                Ok((stream, buf, parsed)) => return Ok(parsed.into_answer(stream, buf, t.connect)),
                Err(f)
                    if idle.is_some_and(|idle| {
                        f.unsent || (f.unanswered && idle >= RESEND_AFTER_IDLE)
                    }) =>
                {
                    resent = true
                }
                Err(f) => return Err(f.reason),
            }
        }
    }

    /// An idle connection to `connect` that is still open, and how long it has been idle.
    fn checkout(&self, connect: &str) -> Option<(TcpStream, Duration)> {
        let mut idle = self.idle.lock().expect("upstream pool");
        let conns = idle.get_mut(connect)?;
        while let Some((stream, since)) = conns.pop() {
            let idle_for = since.elapsed();
            if idle_for < IDLE_TIMEOUT && still_open(&stream) {
                return Some((stream, idle_for));
            }
        }
        None
    }

    fn checkin(&self, connect: String, stream: TcpStream) {
        let mut idle = self.idle.lock().expect("upstream pool");
        idle.entry(connect)
            .or_default()
            .push((stream, Instant::now()));
    }

    /// Closes the idle connections the workers have closed, or idle past `IDLE_TIMEOUT` (the
    /// data plane calls this every few seconds: a worker no longer asked for keeps none).
    pub fn sweep(&self) {
        let mut idle = self.idle.lock().expect("upstream pool");
        idle.retain(|_, conns| {
            conns.retain(|(stream, since)| since.elapsed() < IDLE_TIMEOUT && still_open(stream));
            !conns.is_empty()
        });
    }

    async fn connect(&self, connect: &str) -> Result<TcpStream, String> {
        let fail = |e: &dyn std::fmt::Display| {
            format!("ClientConnectorError: cannot connect to {connect}: {e}")
        };
        let stream =
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(connect)).await {
                Err(_) => return Err(fail(&"connect timed out")),
                Ok(Err(e)) => return Err(fail(&e)),
                Ok(Ok(s)) => s,
            };
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }

    /// Takes back a connection whose answer has been read whole.
    fn release(&self, body: &mut AnswerBody) {
        if body.framing == Framing::Done && body.keep_alive && body.buf.is_empty() {
            if let Some(stream) = body.stream.take() {
                self.checkin(std::mem::take(&mut body.connect), stream);
            }
        }
        body.stream = None;
    }
}

/// An idle pooled connection is usable when nothing is waiting to be read on it: the worker
/// has neither closed it (a read of 0) nor sent anything unasked (bytes past an answer's end).
/// It asks the socket itself (a peek, one system call), also where tokio's record of its
/// readiness says there is nothing, as that record may not have caught up with a close yet.
/// Where the record says readable (it does after an answer read to its end), the peek goes
/// through tokio, so that finding nothing clears it: the request's first read then waits for
/// the answer instead of being a system call that finds nothing too.
fn still_open(stream: &TcpStream) -> bool {
    let peek = || {
        let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        socket2::SockRef::from(stream).peek(&mut probe)
    };
    let mut peeked_through_tokio = false;
    let mut peeked = stream.try_io(Interest::READABLE, || {
        peeked_through_tokio = true;
        peek()
    });
    if !peeked_through_tokio {
        peeked = peek();
    }
    matches!(peeked, Err(e) if e.kind() == io::ErrorKind::WouldBlock)
}

/// Where a worker's URL points.
struct Target<'a> {
    /// `host:port` to connect to (port 80 if the URL gives none); also the pool's key.
    connect: String,
    /// The `Host` header: the URL's host and port as written.
    host: &'a str,
    /// The URL's path, under which the router's paths go (`http://gw/sglang` + `/generate`).
    base: &'a str,
}

fn target(url: &str) -> Result<Target<'_>, String> {
    let bad = |why: &str| format!("bad worker URL {url:?}: {why}");
    let rest = match url.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case("http://") => &url[7..],
        _ => return Err(bad("only http:// is supported")),
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (host, tail) = rest.split_at(end);
    if host.is_empty() {
        return Err(bad("no host"));
    }
    if host.contains('@') {
        return Err(bad("credentials in the URL are not supported"));
    }
    let base = tail.split(['?', '#']).next().unwrap_or_default();
    // A port follows the last ':' that is not inside an IPv6 literal's brackets.
    let after_literal = host.rfind(']').map_or(host, |i| &host[i + 1..]);
    let connect = if after_literal.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:80")
    };
    Ok(Target {
        connect,
        host,
        base: base.trim_end_matches('/'),
    })
}

fn request_head(t: &Target, path: &str, headers: &[(String, String)], len: usize) -> Vec<u8> {
    let mut head = Vec::with_capacity(256);
    head.extend_from_slice(b"POST ");
    head.extend_from_slice(t.base.as_bytes());
    head.extend_from_slice(path.as_bytes());
    head.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    head.extend_from_slice(t.host.as_bytes());
    head.extend_from_slice(b"\r\ncontent-length: ");
    head.extend_from_slice(len.to_string().as_bytes());
    head.extend_from_slice(b"\r\n");
    for (k, v) in headers {
        let bad = |s: &str| s.bytes().any(|b| b == b'\r' || b == b'\n');
        let framing = ["host", "content-length", "transfer-encoding", "connection"]
            .iter()
            .any(|f| k.eq_ignore_ascii_case(f));
        if k.is_empty() || k.contains(':') || bad(k) || bad(v) || framing {
            continue;
        }
        head.extend_from_slice(k.as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(v.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"\r\n");
    head
}

/// What an answer's head says.
struct Parsed {
    status: u16,
    content_type: Option<String>,
    content_encoding: Option<String>,
    framing: Framing,
    keep_alive: bool,
}

impl Parsed {
    fn into_answer(self, stream: TcpStream, buf: BytesMut, connect: String) -> Answer {
        Answer {
            status: self.status,
            content_type: self.content_type,
            content_encoding: self.content_encoding,
            body: AnswerBody {
                stream: Some(stream),
                buf,
                framing: self.framing,
                keep_alive: self.keep_alive,
                connect,
            },
        }
    }
}

/// Sends the request and reads the answer's head: the connection, the bytes read past the
/// head, and what the head says. A worker that answers before it has read the whole request
/// (a 413, say), whether it then closes or stops reading, is heard: sending stops, and its
/// answer comes back, on a connection not to be reused.
async fn exchange(
    stream: TcpStream,
    head: &[u8],
    body: &[u8],
) -> Result<(TcpStream, BytesMut, Parsed), Failure> {
    let (mut h, mut b) = (head, body);
    let mut unsent = None;
    let mut buf = BytesMut::with_capacity(READ_BYTES);
    let mut answered = false;
    while !h.is_empty() || !b.is_empty() {
        match stream.try_write_vectored(&[IoSlice::new(h), IoSlice::new(b)]) {
            Ok(n) => {
                let from_head = n.min(h.len());
                h = &h[from_head..];
                b = &b[n - from_head..];
            }
            // The socket is full: wait until it takes more, or the worker says something.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let early = tokio::select! {
                    w = stream.writable() => w.err(),
                    r = stream.readable() => match r.map(|()| stream.try_read_buf(&mut buf)) {
                        Ok(Ok(0)) => Some(io::ErrorKind::UnexpectedEof.into()),
                        Ok(Ok(_)) => {
                            answered = true;
                            Some(io::Error::other("the worker answered before it had it all"))
                        }
                        Ok(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => None,
                        Ok(Err(e)) | Err(e) => Some(e),
                    },
                };
                if early.is_some() {
                    unsent = early;
                    break;
                }
            }
            Err(e) => {
                unsent = Some(e);
                break;
            }
        }
    }
    let failed = |reason: String, answered: bool, unsent: &Option<io::Error>| Failure {
        reason: match unsent {
            Some(e) => format!("ClientConnectorError: sending the request failed: {e}"),
            None => reason,
        },
        unsent: unsent.is_some(),
        unanswered: !answered,
    };
    loop {
        if !buf.is_empty() {
            if let Some((n, mut parsed)) = parse_head(&buf)? {
                buf.advance(n);
                if (100..200).contains(&parsed.status) {
                    continue; // an interim answer (100 Continue): the real one follows
                }
                parsed.keep_alive &= unsent.is_none();
                return Ok((stream, buf, parsed));
            }
        }
        if buf.len() > MAX_HEAD_BYTES {
            return Err(Failure::new(
                "ClientPayloadError: the worker's answer head is too large",
            ));
        }
        buf.reserve(READ_BYTES);
        let e = match stream.try_read_buf(&mut buf) {
            Ok(0) => {
                let why = "ClientConnectorError: the worker closed the connection before answering";
                return Err(failed(why.into(), answered, &unsent));
            }
            Ok(_) => {
                answered = true;
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => match stream.readable().await {
                Ok(()) => continue,
                Err(e) => e,
            },
            Err(e) => e,
        };
        let reason = format!("ClientConnectorError: {e}");
        return Err(failed(reason, answered, &unsent));
    }
}

/// The head at the start of `buf`, if it is all there: its length and what it says.
fn parse_head(buf: &[u8]) -> Result<Option<(usize, Parsed)>, Failure> {
    let bad = |e: &dyn std::fmt::Display| {
        Failure::new(format!(
            "ClientPayloadError: the worker's answer is not HTTP/1.1: {e}"
        ))
    };
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut slots);
    let n = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(bad(&e)),
    };
    let status = resp.code.unwrap_or(0);
    let (mut content_type, mut content_encoding) = (None, None);
    let (mut length, mut codings) = (None, None::<String>);
    let (mut close, mut keep) = (false, false);
    for h in resp.headers.iter() {
        let text = || String::from_utf8_lossy(h.value).trim().to_owned();
        let has = |token: &str| {
            text()
                .split(',')
                .any(|t| t.trim().eq_ignore_ascii_case(token))
        };
        let is = |name: &str| h.name.eq_ignore_ascii_case(name);
        if is("content-type") {
            content_type = Some(text());
        } else if is("content-encoding") {
            content_encoding = Some(text());
        } else if is("content-length") {
            match text().parse::<u64>() {
                Ok(l) if length.is_none_or(|m| m == l) => length = Some(l),
                _ => return Err(bad(&"a bad or conflicting content-length")),
            }
        } else if is("transfer-encoding") {
            let all = codings.take().map_or(text(), |c| format!("{c},{}", text()));
            codings = Some(all);
        } else if is("connection") {
            close |= has("close");
            keep |= has("keep-alive");
        }
    }
    // Reused only when the answer says it may be and its framing leaves no doubt (RFC 9112
    // 6.3 and 9.3): HTTP/1.1 unless it says close, HTTP/1.0 only if it says keep-alive.
    let mut keep_alive = !close && (resp.version == Some(1) || keep);
    let framing = if status == 204 || status == 304 || (100..200).contains(&status) {
        Framing::Done
    } else if let Some(codings) = codings {
        // A transfer coding overrides a length, and a message with both is not trusted again.
        keep_alive &= length.is_none();
        let last = codings.rsplit(',').next().unwrap_or_default().trim();
        if last.eq_ignore_ascii_case("chunked") {
            Framing::Chunked(Chunk::Size)
        } else {
            keep_alive = false;
            Framing::Close
        }
    } else if let Some(0) = length {
        Framing::Done
    } else if let Some(l) = length {
        Framing::Length(l)
    } else {
        keep_alive = false;
        Framing::Close
    };
    let parsed = Parsed {
        status,
        content_type,
        content_encoding,
        framing,
        keep_alive,
    };
    Ok(Some((n, parsed)))
}

impl AnswerBody {
    /// The body's next data: all that has arrived (`Ok(None)` at its end; the connection then
    /// goes back to `upstream`'s pool if it can carry another request).
    pub fn poll_data(
        &mut self,
        cx: &mut Context<'_>,
        upstream: &Upstream,
    ) -> Poll<Option<Result<Bytes, String>>> {
        // A broken body drops its connection (never to be reused) and says why.
        let broke = |body: &mut Self, e: String| {
            body.stream = None;
            Poll::Ready(Some(Err(e)))
        };
        loop {
            match self.decode() {
                Err(e) => return broke(self, e),
                Ok(Some(data)) => return Poll::Ready(Some(Ok(data))),
                Ok(None) if self.framing == Framing::Done => {
                    upstream.release(self);
                    return Poll::Ready(None);
                }
                Ok(None) => {}
            }
            let Some(stream) = self.stream.as_ref() else {
                return Poll::Ready(None);
            };
            self.buf.reserve(READ_BYTES);
            match stream.try_read_buf(&mut self.buf) {
                Ok(0) if self.framing == Framing::Close => self.framing = Framing::Done,
                Ok(0) => {
                    let e = "the worker closed the connection before the answer's end";
                    return broke(self, e.into());
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    match stream.poll_read_ready(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(e)) => return broke(self, e.to_string()),
                    }
                }
                Err(e) => return broke(self, e.to_string()),
            }
        }
    }

    /// The data in `buf` that the framing says is the body's, all of it at once; moves the
    /// framing on (to `Done` at the body's end).
    fn decode(&mut self) -> Result<Option<Bytes>, String> {
        let mut out: Option<BytesMut> = None;
        let mut take = |buf: &mut BytesMut, n: usize| {
            let piece = buf.split_to(n);
            match out.as_mut() {
                None => out = Some(piece),
                Some(o) => o.extend_from_slice(&piece),
            }
        };
        loop {
            match &mut self.framing {
                Framing::Done => break,
                Framing::Close => {
                    if !self.buf.is_empty() {
                        let n = self.buf.len();
                        take(&mut self.buf, n);
                    }
                    break;
                }
                Framing::Length(left) => {
                    let n = (*left).min(self.buf.len() as u64);
                    if n > 0 {
                        take(&mut self.buf, n as usize);
                        *left -= n;
                    }
                    if *left == 0 {
                        self.framing = Framing::Done;
                    }
                    break;
                }
                Framing::Chunked(state) => match state {
                    Chunk::Size => {
                        let Some(end) = find_crlf(&self.buf)? else {
                            break;
                        };
                        let line = &self.buf[..end];
                        let digits = line.split(|&b| b == b';').next().unwrap_or_default();
                        let size = std::str::from_utf8(digits)
                            .ok()
                            .and_then(|d| u64::from_str_radix(d.trim(), 16).ok())
                            .ok_or("a bad chunk size in the worker's answer")?;
                        self.buf.advance(end + 2);
                        *state = if size == 0 {
                            Chunk::Trailer
                        } else {
                            Chunk::Data(size)
                        };
                    }
                    Chunk::Data(left) => {
                        let n = (*left).min(self.buf.len() as u64);
                        if n == 0 {
                            break;
                        }
                        take(&mut self.buf, n as usize);
                        *left -= n;
                        if *left == 0 {
                            *state = Chunk::DataEnd;
                        }
                    }
                    Chunk::DataEnd => {
                        if self.buf.len() < 2 {
                            break;
                        }
                        if &self.buf[..2] != b"\r\n" {
                            return Err(
                                "a chunk without its closing CRLF in the worker's answer".into()
                            );
                        }
                        self.buf.advance(2);
                        *state = Chunk::Size;
                    }
                    Chunk::Trailer => {
                        let Some(end) = find_crlf(&self.buf)? else {
                            break;
                        };
                        self.buf.advance(end + 2);
                        if end == 0 {
                            self.framing = Framing::Done;
                        }
                    }
                },
            }
        }
        Ok(out.map(BytesMut::freeze))
    }
}

/// Where the first CRLF in `buf` is, if a whole line is there (a line is at most a few KB).
fn find_crlf(buf: &[u8]) -> Result<Option<usize>, String> {
    match memchr::memmem::find(buf, b"\r\n") {
        Some(i) => Ok(Some(i)),
        None if buf.len() > 8 << 10 => {
            Err("an overlong line in the worker's chunked answer".into())
        }
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(framing: Framing, bytes: &[u8]) -> AnswerBody {
        AnswerBody {
            stream: None,
            buf: BytesMut::from(bytes),
            framing,
            keep_alive: true,
            connect: String::new(),
        }
    }

    /// Feeds `wire` in pieces of `step` bytes; what comes out, and whether the body ended.
    fn feed(framing: Framing, wire: &[u8], step: usize) -> (Vec<u8>, bool) {
        let mut b = body(framing, b"");
        let mut out = Vec::new();
        for piece in wire.chunks(step) {
            b.buf.extend_from_slice(piece);
            while let Some(data) = b.decode().expect("valid") {
                out.extend_from_slice(&data);
            }
        }
        (out, b.framing == Framing::Done)
    }

    #[test]
    fn chunked_bodies_decode_whole_however_they_arrive() {
        let wire = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n";
        for step in [1, 2, 3, 7, wire.len()] {
            assert_eq!(
                feed(Framing::Chunked(Chunk::Size), wire, step),
                (b"hello, world".to_vec(), true),
                "step {step}"
            );
        }
        // Not ended without the last chunk.
        let (out, done) = feed(Framing::Chunked(Chunk::Size), b"5\r\nhello\r\n", 4);
        assert_eq!((out, done), (b"hello".to_vec(), false));
    }

    #[test]
    fn all_chunks_at_hand_come_out_as_one_piece() {
        let mut b = body(
            Framing::Chunked(Chunk::Size),
            b"3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n",
        );
        assert_eq!(b.decode().unwrap().as_deref(), Some(&b"abcdef"[..]));
        assert_eq!(b.framing, Framing::Done);
        assert!(b.buf.is_empty());
    }

    #[test]
    fn length_bodies_stop_at_their_length() {
        let mut b = body(Framing::Length(4), b"abcdEXTRA");
        assert_eq!(b.decode().unwrap().as_deref(), Some(&b"abcd"[..]));
        assert_eq!(b.framing, Framing::Done);
        assert_eq!(&b.buf[..], b"EXTRA"); // left there: the connection is not reused
    }

    #[test]
    fn malformed_chunks_are_errors() {
        assert!(body(Framing::Chunked(Chunk::Size), b"zz\r\n")
            .decode()
            .is_err());
        assert!(body(Framing::Chunked(Chunk::Size), b"3\r\nabcXY")
            .decode()
            .is_err());
        assert!(body(Framing::Chunked(Chunk::Size), &[b'1'; 9000])
            .decode()
            .is_err());
    }

    #[test]
    fn heads_say_how_the_body_is_framed_and_whether_to_keep_the_connection() {
        let parse = |h: &[u8]| match parse_head(h) {
            Ok(Some((n, p))) => (n, p.status, p.framing, p.keep_alive, p.content_type),
            _ => panic!("not parsed"),
        };
        let h = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\nrest";
        assert_eq!(
            parse(h),
            (
                h.len() - 4,
                200,
                Framing::Chunked(Chunk::Size),
                true,
                Some("text/event-stream".into())
            )
        );
        let h = b"HTTP/1.1 503 Busy\r\nContent-Length: 2\r\nConnection: close\r\n\r\n";
        assert_eq!(parse(h).1..parse(h).1, 503..503);
        assert_eq!((parse(h).2, parse(h).3), (Framing::Length(2), false));
        let h = b"HTTP/1.0 200 OK\r\n\r\n"; // to the connection's end
        assert_eq!((parse(h).2, parse(h).3), (Framing::Close, false));
        let h = b"HTTP/1.1 204 No Content\r\n\r\n";
        assert_eq!(parse(h).2, Framing::Done);
        assert!(matches!(
            parse_head(b"HTTP/1.1 200 OK\r\nContent-Le"),
            Ok(None)
        ));
        assert!(parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n").is_err());
        assert!(
            parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n")
                .is_err()
        );
        assert!(parse_head(b"garbage\r\n\r\n").is_err());
        // Close is sticky; a coding overrides a length, and both end the connection's reuse.
        let h = b"HTTP/1.1 200 OK\r\nConnection: close\r\nConnection: keep-alive\r\n\r\n";
        assert!(!parse(h).3);
        let h = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(
            (parse(h).2, parse(h).3),
            (Framing::Chunked(Chunk::Size), false)
        );
        let h = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nContent-Length: 5\r\n\r\n";
        assert_eq!((parse(h).2, parse(h).3), (Framing::Close, false));
        let h = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(
            (parse(h).2, parse(h).3),
            (Framing::Chunked(Chunk::Size), true)
        );
        let h = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\n";
        assert_eq!((parse(h).2, parse(h).3), (Framing::Length(1), true));
    }

    /// A worker on a local port: on each connection it answers the first `answer` requests
    /// ("ok", kept alive), then closes the connection: at the next request, without answering
    /// it, or with `at_once`, right away. Returns its URL and the count of connections it
    /// accepted.
    async fn worker(
        answer: usize,
        at_once: bool,
    ) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let accepted = std::sync::Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    for _ in 0..answer {
                        // One request: its head, then its content-length bytes.
                        let head_end = loop {
                            if let Some(i) = memchr::memmem::find(&buf, b"\r\n\r\n") {
                                break i + 4;
                            }
                            let mut b = [0u8; 4096];
                            match s.read(&mut b).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&b[..n]),
                            }
                        };
                        let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
                        let len: usize = head
                            .split("content-length: ")
                            .nth(1)
                            .and_then(|r| r.split("\r\n").next())
                            .and_then(|l| l.parse().ok())
                            .unwrap();
                        while buf.len() < head_end + len {
                            let mut b = [0u8; 4096];
                            let n = s.read(&mut b).await.unwrap();
                            buf.extend_from_slice(&b[..n]);
                        }
                        buf.drain(..head_end + len);
                        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if s.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                    if !at_once {
                        let mut b = [0u8; 4096];
                        let _ = s.read(&mut b).await; // the next request, unanswered
                    }
                });
            }
        });
        (url, accepted)
    }

    async fn read_all(up: &Upstream, body: &mut AnswerBody) -> Vec<u8> {
        let mut out = Vec::new();
        while let Some(data) = std::future::poll_fn(|cx| body.poll_data(cx, up)).await {
            out.extend_from_slice(&data.unwrap());
        }
        out
    }

    #[tokio::test]
    async fn a_kept_alive_connection_carries_the_next_request() {
        let (url, accepted) = worker(usize::MAX, false).await;
        let up = Upstream::new(Duration::from_secs(1));
        for _ in 0..3 {
            let mut a = up.post(&url, "/generate", &[], b"{}").await.unwrap();
            assert_eq!(
                (a.status, read_all(&up, &mut a.body).await),
                (200, b"ok".to_vec())
            );
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_pooled_connection_the_worker_has_closed_is_replaced() {
        use std::sync::atomic::Ordering::SeqCst;
        let up = Upstream::new(Duration::from_secs(1));
        let ok = |url: String| {
            let up = &up;
            async move {
                let mut a = up.post(&url, "/generate", &[], b"{}").await.unwrap();
                assert_eq!(read_all(up, &mut a.body).await, b"ok".to_vec());
            }
        };
        // Closed unanswered right after its last use: the worker may have read the request,
        // so it is a failure (the router retries elsewhere), not sent again.
        let (url, accepted) = worker(1, false).await;
        ok(url.clone()).await;
        let err = up.post(&url, "/generate", &[], b"{}").await.err().unwrap();
        assert!(err.contains("closed the connection"), "{err}");
        ok(url.clone()).await; // on a fresh connection
        assert_eq!(accepted.load(SeqCst), 2);
        // Closed unanswered after an idle spell (a keep-alive timeout racing the request):
        // sent again, once, on a fresh connection.
        tokio::time::sleep(RESEND_AFTER_IDLE + Duration::from_millis(50)).await;
        ok(url.clone()).await;
        assert_eq!(accepted.load(SeqCst), 3);
        // A fresh connection closed without an answer is a failure, not sent again.
        let (url, accepted) = worker(0, false).await;
        let err = up.post(&url, "/generate", &[], b"{}").await.err().unwrap();
        assert!(err.contains("closed the connection"), "{err}");
        assert_eq!(accepted.load(SeqCst), 1);
        // Closed as soon as it has answered: noticed at checkout, never an error.
        let (url, accepted) = worker(1, true).await;
        for pause in [0, 20, 0, 20] {
            ok(url.clone()).await;
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
        assert_eq!(accepted.load(SeqCst), 4);
        // What the sweep leaves: nothing the worker has closed.
        let (url, _) = worker(usize::MAX, false).await;
        ok(url.clone()).await;
        let (closed, _) = worker(1, true).await;
        ok(closed.clone()).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        up.sweep();
        {
            let idle = up.idle.lock().unwrap();
            assert_eq!(idle.get(&url[7..]).map(Vec::len), Some(1));
            assert!(!idle.contains_key(&closed[7..]));
        }
        // Nobody listening.
        let dead = format!("http://{}", {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        });
        let err = up.post(&dead, "/generate", &[], b"{}").await.err().unwrap();
        assert!(
            err.starts_with("ClientConnectorError: cannot connect"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn an_answer_before_the_whole_request_is_heard() {
        for close in [false, true] {
            early_answer(close).await;
        }
    }

    /// A worker that reads a request's head only, refuses its body (413), and stops reading,
    /// closing its side or not.
    async fn early_answer(close: bool) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut b = [0u8; 4096];
            let _ = s.read(&mut b).await;
            let answer = b"HTTP/1.1 413 Too Large\r\ncontent-length: 2\r\n\r\nno";
            let _ = s.write_all(answer).await;
            if close {
                let _ = s.shutdown().await;
            }
            tokio::time::sleep(Duration::from_secs(30)).await; // reading no more
        });
        let up = Upstream::new(Duration::from_secs(1));
        let body = vec![b'x'; 64 << 20]; // more than the sockets' buffers take
        let post = up.post(&url, "/generate", &[], &body);
        let mut a = tokio::time::timeout(Duration::from_secs(10), post)
            .await
            .expect("the answer, not a wait for the rest of the request to be read")
            .unwrap();
        assert_eq!(
            (a.status, read_all(&up, &mut a.body).await),
            (413, b"no".to_vec())
        );
        assert!(up.idle.lock().unwrap().is_empty()); // not kept: the body was not sent
    }

    #[test]
    fn request_heads_carry_the_framing_and_only_safe_headers() {
        let headers = vec![
            ("Content-Type".to_owned(), "application/json".to_owned()),
            ("X-Bad".to_owned(), "a\r\nInjected: 1".to_owned()),
            ("Content-Length".to_owned(), "999".to_owned()),
        ];
        let head = request_head(&target("http://w:1").unwrap(), "/generate", &headers, 12);
        assert_eq!(
            head,
            b"POST /generate HTTP/1.1\r\nhost: w:1\r\ncontent-length: 12\r\n\
              Content-Type: application/json\r\n\r\n"
                .to_vec()
        );
        let t = |url| {
            let t = target(url).unwrap();
            (t.connect, t.host, t.base)
        };
        assert_eq!(
            t("http://127.0.0.1:8000/"),
            ("127.0.0.1:8000".into(), "127.0.0.1:8000", "")
        );
        assert_eq!(
            t("HTTP://gw/sglang/?x#y"),
            ("gw:80".into(), "gw", "/sglang")
        );
        assert_eq!(
            t("http://[::1]:8000"),
            ("[::1]:8000".into(), "[::1]:8000", "")
        );
        assert_eq!(t("http://[::1]"), ("[::1]:80".into(), "[::1]", ""));
        let head = request_head(&target("http://gw/sglang").unwrap(), "/generate", &[], 0);
        assert!(head.starts_with(b"POST /sglang/generate HTTP/1.1\r\nhost: gw\r\n"));
        for bad in ["https://x", "http://", "http://u:p@x", "x:1"] {
            assert!(target(bad).is_err(), "{bad}");
        }
    }
}
