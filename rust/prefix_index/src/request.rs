//! Keying a generation request straight from its body bytes: the router's fast path.
//!
//! `smetric.request.view_request` (Python, over the parsed body) is the reference; this module
//! produces the same prompt (the chat serialization its docstring describes, the text, or the
//! token ids) and the same few facts, without building Python objects for a body that is mostly
//! two or three long strings. One pass validates the body as JSON; a string without escapes is
//! used where it lies in the body, and the others are decoded into one buffer. A text prompt
//! that is one string is then not copied at all, and the chat serialization is a list of pieces:
//! its long strings where they lie, and what it writes (tags, short strings, compact JSON) in a
//! second buffer; the keys are hashed across the pieces (`keys::hash_text_pieces`). Both buffers
//! are the caller's (`Scratch`), kept from body to body.
//!
//! It answers only when it is sure: anything the reference would reject, and anything whose
//! Python value is awkward to reproduce (floats in serialized JSON, integers beyond 64 bits,
//! lone surrogates, deep nesting, non-string `tool_call_id`s), yields `None`, and the caller
//! takes the reference path, which then gives the answer or the error.

use crate::copy;

/// Which API a body belongs to (the reference's `api` argument).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Generate,
    Chat,
    Completions,
}

/// A body's prompt, ready to key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt<'a> {
    /// UTF-8 text: in the body where it is a string there without escapes, else in the
    /// caller's `Scratch`.
    Text(&'a [u8]),
    /// Text in pieces, to be read one after the other: the chat serialization of tools and
    /// messages, whose long strings are not copied to put it together.
    Pieces(Vec<&'a [u8]>),
    Tokens(Vec<u32>),
}

/// What the fast path reads from a body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BodyView<'a> {
    pub prompt: Prompt<'a>,
    /// `None`: the body names no limit (the caller applies its default).
    pub max_new_tokens: Option<u64>,
    pub stream: bool,
    /// Chat only: no assistant or tool message yet.
    pub is_first_turn: Option<bool>,
}

/// The buffers keying writes into: the decoded strings, and what the chat serialization writes.
/// Kept from one body to the next, so that keying a long prompt does not take fresh memory each
/// time: glibc may give an allocation of 128 KB or more pages of its own, which then fault in on
/// every request (in one allocation pattern measured here, 126 KB chat bodies took 135-173 µs
/// to view, and 43-52 µs with the buffers kept). The parsed value tree lives here too, so that
/// parsing a body allocates nothing once the buffers have grown to its size.
#[derive(Debug, Default)]
pub struct Scratch {
    decoded: Vec<u8>,
    text: Vec<u8>,
    tree: Tree,
}

impl Scratch {
    /// Shrinks a buffer that has grown past `max` bytes (for a rare huge body) back to `max`.
    pub fn trim(&mut self, max: usize) {
        for buf in [&mut self.decoded, &mut self.text] {
            if buf.capacity() > max {
                buf.truncate(max); // past `filled`, nothing in it is read
                buf.shrink_to(max);
            }
        }
        self.tree.trim(max);
    }
}

/// A body's arrays and objects: their items and members, each container's back to back
/// (`Value::Array` and `Value::Object` name their range), and the stacks they are parsed on.
/// A container's elements are parsed onto a stack (a nested container's own elements come and
/// go above them meanwhile) and moved here in one piece when it closes.
#[derive(Debug, Default)]
struct Tree {
    items: Vec<Value>,
    members: Vec<(Span, Value)>,
    item_stack: Vec<Value>,
    member_stack: Vec<(Span, Value)>,
}

/// Closes a container whose elements are `stack[base..]`: moves them to the end of `elements`
/// and returns where they are.
fn close<T>(elements: &mut Vec<T>, stack: &mut Vec<T>, base: usize) -> Elements {
    let start = elements.len() as u32;
    elements.extend(stack.drain(base..));
    Elements {
        start,
        end: elements.len() as u32,
    }
}

impl Tree {
    fn clear(&mut self) {
        self.items.clear();
        self.members.clear();
        self.item_stack.clear();
        self.member_stack.clear();
    }

    /// Shrinks what holds more than `max` bytes' worth back to that.
    fn trim(&mut self, max: usize) {
        fn shrink<T>(v: &mut Vec<T>, max: usize) {
            let max = max / std::mem::size_of::<T>();
            if v.capacity() > max {
                v.clear();
                v.shrink_to(max);
            }
        }
        shrink(&mut self.items, max);
        shrink(&mut self.members, max);
        shrink(&mut self.item_stack, max);
        shrink(&mut self.member_stack, max);
    }
}

/// Nesting beyond this is left to the reference (whose parsers allow more).
const MAX_DEPTH: usize = 128;

/// A string's decoded bytes: a range of the body (for a string without escapes, which is its
/// own decoding) or of `Doc::text`; also a number's literal. Packed in one word (start, end,
/// and whether it is decoded in the top bit; a body of 2 GiB or more is left to the reference):
/// with three fields, the values holding it were written and read back in pieces of different
/// sizes, and viewing a real agent turn's body (tau-bench, 42 KB) took 63.1 against 53.7 µs at
/// best (`keying_pieces`, six alternating runs).
#[derive(Clone, Copy, Debug)]
struct Span(u64);

impl Span {
    const DECODED: u64 = 1 << 63;

    fn new(range: std::ops::Range<usize>, decoded: bool) -> Span {
        Span(range.start as u64 | (range.end as u64) << 32 | u64::from(decoded) << 63)
    }

    fn range(self) -> std::ops::Range<usize> {
        (self.0 as u32) as usize..((self.0 & !Self::DECODED) >> 32) as usize
    }

    fn decoded(self) -> bool {
        self.0 & Self::DECODED != 0
    }

    fn is_empty(self) -> bool {
        self.range().is_empty()
    }
}

/// A range of `Tree::items` or `Tree::members`.
#[derive(Clone, Copy, Debug)]
struct Elements {
    start: u32,
    end: u32,
}

impl Elements {
    fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.end as usize
    }

    fn is_empty(self) -> bool {
        self.end == self.start
    }
}

#[derive(Clone, Copy, Debug)]
enum Value {
    Null,
    Bool(bool),
    /// The literal (a range of the body), validated against JSON's number grammar.
    Number(Span),
    Str(Span),
    /// Its items, in `Doc::items`.
    Array(Elements),
    /// Its members in body order, in `Doc::members`, duplicates kept (lookups take the last, as
    /// a parsed dict does).
    Object(Elements),
}

/// A parsed body: its value tree, the body, and the decoded text of its strings with escapes.
struct Doc<'a> {
    root: Value,
    body: &'a [u8],
    text: &'a [u8],
    items: &'a [Value],
    members: &'a [(Span, Value)],
}

impl<'a> Doc<'a> {
    fn str(&self, s: Span) -> &'a [u8] {
        let from = if s.decoded() { self.text } else { self.body };
        &from[s.range()]
    }

    fn items(&self, e: Elements) -> &'a [Value] {
        &self.items[e.range()]
    }

    fn members(&self, e: Elements) -> &'a [(Span, Value)] {
        &self.members[e.range()]
    }

    /// The member of `object` named `key` (the last one, as in a dict parsed from the body).
    fn get(&self, object: &Value, key: &[u8]) -> Option<&'a Value> {
        match *object {
            Value::Object(members) => self
                .members(members)
                .iter()
                .rev()
                .find(|(k, _)| self.str(*k) == key)
                .map(|m| &m.1),
            _ => None,
        }
    }

    /// `get`, with a JSON null read as absent (Python's `d.get(k) is None`).
    fn get_some(&self, object: &Value, key: &[u8]) -> Option<&'a Value> {
        self.get(object, key).filter(|v| !matches!(v, Value::Null))
    }

    fn is_str(&self, v: &Value, s: &[u8]) -> bool {
        matches!(*v, Value::Str(span) if self.str(span) == s)
    }

    /// Python's `bool(value)` for a parsed JSON value; `None` where a float decides.
    fn truthy(&self, v: &Value) -> Option<bool> {
        Some(match *v {
            Value::Null => false,
            Value::Bool(b) => b,
            // An integer literal of any size (the reference may see a float beyond 64 bits).
            Value::Number(lit) => {
                let lit = self.str(lit);
                if lit.iter().any(|b| matches!(b, b'.' | b'e' | b'E')) {
                    return None;
                }
                lit.iter().any(|b| matches!(b, b'1'..=b'9'))
            }
            Value::Str(s) => !s.is_empty(),
            Value::Array(items) => !items.is_empty(),
            Value::Object(members) => !members.is_empty(),
        })
    }
}

/// An integer literal's value; `None` for a float literal or one beyond 64 bits (the reference
/// sees a float or a big int there; either way, its business).
fn int_literal(lit: &[u8]) -> Option<i128> {
    if lit.iter().any(|b| matches!(b, b'.' | b'e' | b'E')) {
        return None;
    }
    let v: i128 = std::str::from_utf8(lit).ok()?.parse().ok()?;
    (i64::MIN as i128..=u64::MAX as i128)
        .contains(&v)
        .then_some(v)
}

// ---- parsing -----------------------------------------------------------------------------

/// Bytes a string scan checks at once: one SSE2 register's worth.
const LANE: usize = 16;
/// Bytes a string scan takes in one step (of whole lanes).
const CHUNK: usize = 2 * LANE;

/// A bit per byte of `lane` (bit `i` for byte `i`) that is `"`, `\` or a control character
/// (below 0x20): the bytes a string scan must stop at; and a bit per byte that is not ASCII.
#[cfg(target_arch = "x86_64")]
#[inline]
fn string_stops(lane: [u8; LANE]) -> (u32, u32) {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_max_epu8, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
    };
    let v: __m128i = bytemuck::cast(lane);
    // SAFETY: these intrinsics only need SSE2, which every x86_64 CPU has (it is part of the
    // architecture's baseline), and they touch no memory: only the value `v`.
    let (stops, high) = unsafe {
        let quote = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'"' as i8));
        let backslash = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\\' as i8));
        let low = _mm_set1_epi8(0x1f);
        let control = _mm_cmpeq_epi8(_mm_max_epu8(v, low), low); // v <= 0x1f, unsigned
        let stops = _mm_or_si128(_mm_or_si128(quote, backslash), control);
        (_mm_movemask_epi8(stops), _mm_movemask_epi8(v))
    };
    (stops as u32, high as u32)
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn string_stops(lane: [u8; LANE]) -> (u32, u32) {
    let (mut stops, mut high) = (0u32, 0u32);
    for (i, &b) in lane.iter().enumerate() {
        stops |= u32::from(b == b'"' || b == b'\\' || b < 0x20) << i;
        high |= u32::from(b >= 0x80) << i;
    }
    (stops, high)
}

/// `string_stops` for a whole chunk: bit `i` for byte `i`.
#[inline]
fn chunk_stops(chunk: &[u8; CHUNK]) -> (u32, u32) {
    let (lo, lo_high) = string_stops(chunk[..LANE].try_into().expect("a lane"));
    let (hi, hi_high) = string_stops(chunk[LANE..].try_into().expect("a lane"));
    (lo | hi << LANE, lo_high | hi_high)
}

/// `chunk_stops` in one AVX2 register, for CPUs that have it (most x86_64 CPUs since 2013). A
/// 128 KB chat body without escapes was viewed in 9.5 against 12.2 µs at best (`keying_pieces`,
/// six alternating runs of each build, on a VM whose speed varied: the medians of the runs'
/// best were 10.1 against 20.2 µs).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn chunk_stops_wide(chunk: &[u8; CHUNK]) -> (u32, u32) {
    use std::arch::x86_64::{
        __m256i, _mm256_cmpeq_epi8, _mm256_loadu_si256, _mm256_max_epu8, _mm256_movemask_epi8,
        _mm256_or_si256, _mm256_set1_epi8,
    };
    // SAFETY: an unaligned load of the chunk's 32 bytes, all of which it has.
    let v = unsafe { _mm256_loadu_si256(chunk.as_ptr().cast::<__m256i>()) };
    let quote = _mm256_cmpeq_epi8(v, _mm256_set1_epi8(b'"' as i8));
    let backslash = _mm256_cmpeq_epi8(v, _mm256_set1_epi8(b'\\' as i8));
    let low = _mm256_set1_epi8(0x1f);
    let control = _mm256_cmpeq_epi8(_mm256_max_epu8(v, low), low); // v <= 0x1f, unsigned
    let stops = _mm256_or_si256(_mm256_or_si256(quote, backslash), control);
    (
        _mm256_movemask_epi8(stops) as u32,
        _mm256_movemask_epi8(v) as u32,
    )
}

/// `chunk_stops`, in one AVX2 register where `WIDE`. Code with `WIDE` runs only where the CPU
/// has AVX2, inlined into a function compiled for it (`Parser::string_wide`).
#[inline(always)]
fn stops<const WIDE: bool>(chunk: &[u8; CHUNK]) -> (u32, u32) {
    #[cfg(target_arch = "x86_64")]
    if WIDE {
        // SAFETY: `WIDE` code runs only on a CPU with AVX2 (see `Parser::string`).
        return unsafe { chunk_stops_wide(chunk) };
    }
    chunk_stops(chunk)
}

/// Whether strings are scanned with AVX2: where the CPU has it.
fn wide_lanes() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Where the run of string bytes from `pos` ends: at the first `"`, `\` or control character,
/// or at the body's end. `high` is made non-zero if the run has a byte beyond ASCII (and may be
/// by one just past it, in the same chunk: harmless, as it only decides whether the string is
/// checked to be UTF-8).
#[inline(always)]
fn clean_run<const WIDE: bool>(bytes: &[u8], mut pos: usize, high: &mut u32) -> usize {
    while let Some(chunk) = bytes.get(pos..pos + CHUNK) {
        let (stops, chunk_high) = stops::<WIDE>(chunk.try_into().expect("a whole chunk"));
        *high |= chunk_high;
        if stops != 0 {
            return pos + stops.trailing_zeros() as usize;
        }
        pos += CHUNK;
    }
    // The body's last few bytes.
    while let Some(&b) = bytes.get(pos) {
        if matches!(b, b'"' | b'\\' | 0..=0x1f) {
            break;
        }
        *high |= u32::from(b >= 0x80);
        pos += 1;
    }
    pos
}

fn hex4(b: &[u8]) -> Option<u32> {
    let mut v = 0u32;
    for &c in b.get(..4)? {
        v = v * 16 + (c as char).to_digit(16)?;
    }
    Some(v)
}

struct Parser<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// Decoded strings, back to back, in `text[..filled]`; beyond that, room to write into
    /// (what a previous body left there, or zeros).
    text: &'a mut Vec<u8>,
    filled: usize,
    tree: &'a mut Tree,
    /// Scan strings with AVX2: set only where the CPU has it (`parse`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    wide: bool,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.pos + word.len();
        (self.bytes.get(self.pos..end)? == word).then(|| self.pos = end)
    }

    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.skip_ws();
        match self.peek()? {
            b'{' => {
                self.pos += 1;
                let base = self.tree.member_stack.len();
                self.skip_ws();
                if self.peek()? == b'}' {
                    self.pos += 1;
                    return Some(Value::Object(Elements { start: 0, end: 0 }));
                }
                loop {
                    self.skip_ws();
                    if self.peek()? != b'"' {
                        return None;
                    }
                    self.pos += 1;
                    let key = self.string()?;
                    self.skip_ws();
                    if self.peek()? != b':' {
                        return None;
                    }
                    self.pos += 1;
                    let v = self.value(depth + 1)?;
                    self.tree.member_stack.push((key, v));
                    self.skip_ws();
                    match self.peek()? {
                        b',' => self.pos += 1,
                        b'}' => {
                            self.pos += 1;
                            let tree = &mut *self.tree;
                            return Some(Value::Object(close(
                                &mut tree.members,
                                &mut tree.member_stack,
                                base,
                            )));
                        }
                        _ => return None,
                    }
                }
            }
            b'[' => {
                self.pos += 1;
                let base = self.tree.item_stack.len();
                self.skip_ws();
                if self.peek()? == b']' {
                    self.pos += 1;
                    return Some(Value::Array(Elements { start: 0, end: 0 }));
                }
                loop {
                    let v = self.value(depth + 1)?;
                    self.tree.item_stack.push(v);
                    self.skip_ws();
                    match self.peek()? {
                        b',' => self.pos += 1,
                        b']' => {
                            self.pos += 1;
                            let tree = &mut *self.tree;
                            return Some(Value::Array(close(
                                &mut tree.items,
                                &mut tree.item_stack,
                                base,
                            )));
                        }
                        _ => return None,
                    }
                }
            }
            b'"' => {
                self.pos += 1;
                self.string().map(Value::Str)
            }
            b't' => self.literal(b"true").map(|_| Value::Bool(true)),
            b'f' => self.literal(b"false").map(|_| Value::Bool(false)),
            b'n' => self.literal(b"null").map(|_| Value::Null),
            _ => self.number().map(Value::Number),
        }
    }

    /// Reads a string, from just after its opening quote; leaves `pos` after the closing one.
    /// Until its first escape, a string is only scanned; from there on, it is decoded into
    /// `text`. Strings are the only place JSON allows bytes beyond ASCII; a string that has any
    /// is checked to be UTF-8.
    fn string(&mut self) -> Option<Span> {
        #[cfg(target_arch = "x86_64")]
        if self.wide {
            // SAFETY: `wide` is set only where the CPU has AVX2 (`parse`).
            return unsafe { self.string_wide() };
        }
        self.string_with::<false>()
    }

    /// `string`, compiled for AVX2 (with the scans inlined into it).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn string_wide(&mut self) -> Option<Span> {
        self.string_with::<true>()
    }

    #[inline(always)]
    fn string_with<const WIDE: bool>(&mut self) -> Option<Span> {
        let bytes = self.bytes;
        let raw_start = self.pos;
        let mut high = 0;
        let mut pos = clean_run::<WIDE>(bytes, raw_start, &mut high);
        let decoded = match *bytes.get(pos)? {
            b'"' => None,
            b'\\' => {
                let start = self.filled;
                pos = self.decode::<WIDE>(raw_start, pos, &mut high)?;
                Some(start)
            }
            _ => return None, // a control character
        };
        if high != 0 {
            std::str::from_utf8(&bytes[raw_start..pos]).ok()?;
        }
        self.pos = pos + 1;
        Some(match decoded {
            Some(start) => Span::new(start..self.filled, true),
            None => Span::new(raw_start..pos, false),
        })
    }

    /// Decodes a string into `text[filled..]`, from its start `raw_start` and its first escape
    /// (the backslash at `pos`); returns where its closing quote is.
    ///
    /// The body is taken a chunk at a time at fixed steps, so that where the next chunk is does
    /// not depend on where the last escape was. In a chunk, the quotes, backslashes and control
    /// characters are found at once, as bits, and each run between them is stored as a whole
    /// chunk where the decoded text goes on: the next store overwrites what lies past the run.
    /// `text` is grown once per body so that such a store always fits (decoded text is never
    /// longer than what it decodes). The body's last two chunks are decoded a run at a time.
    #[inline(always)]
    fn decode<const WIDE: bool>(
        &mut self,
        raw_start: usize,
        pos: usize,
        high: &mut u32,
    ) -> Option<usize> {
        let bytes = self.bytes;
        let room = self.filled + (bytes.len() - raw_start) + CHUNK;
        if self.text.len() < room {
            self.text.resize(room, 0);
        }
        let text = &mut self.text[..];
        let mut out = self.filled;
        copy::copy(
            &mut text[out..out + (pos - raw_start)],
            &bytes[raw_start..pos],
        );
        out += pos - raw_start;
        // The chunk at `base`; its bytes before `done` are decoded (`done` may lie in the next
        // chunk, after an escape that crosses into it).
        let mut base = pos;
        let mut done = 0;
        while let Some(window) = bytes.get(base..base + 2 * CHUNK) {
            let (stops, chunk_high) = stops::<WIDE>(window[..CHUNK].try_into().expect("a chunk"));
            *high |= chunk_high;
            // (In 64 bits, as `done` may lie past the chunk: up to 43, after a pair of `\u`
            // escapes begun at its end.)
            let mut stops = u64::from(stops) & (!0u64 << done);
            while stops != 0 {
                let stop = stops.trailing_zeros() as usize;
                text[out..out + CHUNK].copy_from_slice(&window[done..done + CHUNK]);
                out += stop - done;
                match window[stop] {
                    b'\\' => (done, out) = escape(bytes, base + stop, text, out)?,
                    b'"' => {
                        self.filled = out;
                        return Some(base + stop);
                    }
                    _ => return None, // a control character
                }
                done -= base;
                stops &= !0u64 << done;
            }
            if done < CHUNK {
                text[out..out + CHUNK].copy_from_slice(&window[done..done + CHUNK]);
                out += CHUNK - done;
                done = CHUNK;
            }
            base += CHUNK;
            done -= CHUNK;
        }
        // The body's last bytes, a run at a time.
        let mut pos = base + done;
        loop {
            let end = clean_run::<WIDE>(bytes, pos, high);
            text[out..out + (end - pos)].copy_from_slice(&bytes[pos..end]);
            out += end - pos;
            match *bytes.get(end)? {
                b'\\' => (pos, out) = escape(bytes, end, text, out)?,
                b'"' => {
                    self.filled = out;
                    return Some(end);
                }
                _ => return None, // a control character
            }
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
        self.pos - start
    }

    /// Reads a number; its literal's span of the body.
    fn number(&mut self) -> Option<Span> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek()? {
            b'0' => self.pos += 1,
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            if self.digits() == 0 {
                return None;
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return None;
            }
        }
        Some(Span::new(start..self.pos, false))
    }
}

/// What each byte after a backslash decodes to, for the one-letter escapes; 0 for `u` (decoded
/// apart) and for every byte JSON allows no escape of.
const UNESCAPE: [u8; 256] = {
    let mut t = [0u8; 256];
    t[b'n' as usize] = b'\n';
    t[b'"' as usize] = b'"';
    t[b'\\' as usize] = b'\\';
    t[b't' as usize] = b'\t';
    t[b'r' as usize] = b'\r';
    t[b'/' as usize] = b'/';
    t[b'b' as usize] = 0x08;
    t[b'f' as usize] = 0x0c;
    t
};

/// Decodes the escape at `pos` (its backslash) into `text[out..]`; returns where it ends in
/// `bytes` and in `text`.
#[inline(always)]
fn escape(bytes: &[u8], pos: usize, text: &mut [u8], out: usize) -> Option<(usize, usize)> {
    let letter = *bytes.get(pos + 1)?;
    let decoded = UNESCAPE[usize::from(letter)];
    if decoded == 0 {
        return match letter {
            b'u' => unicode_escape(bytes, pos, text, out),
            _ => None,
        };
    }
    text[out] = decoded;
    Some((pos + 2, out + 1))
}

/// Decodes the `\\u` escape at `pos` (its backslash) into `text[out..]`; returns where it ends
/// in `bytes` and in `text`. A surrogate must pair up with the escape after it; a lone one is
/// left to the reference.
#[cold]
fn unicode_escape(bytes: &[u8], pos: usize, text: &mut [u8], out: usize) -> Option<(usize, usize)> {
    let mut code = hex4(bytes.get(pos + 2..)?)?;
    let mut end = pos + 6;
    match code {
        0xD800..=0xDBFF => {
            if bytes.get(end..end + 2)? != b"\\u" {
                return None;
            }
            let low = hex4(bytes.get(end + 2..)?)?;
            if !(0xDC00..=0xDFFF).contains(&low) {
                return None;
            }
            end += 6;
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
        }
        0xDC00..=0xDFFF => return None,
        _ => {}
    }
    // At most 4 bytes of UTF-8 for the 6 or 12 of the escape.
    let ch = char::from_u32(code)?;
    let len = ch.len_utf8();
    ch.encode_utf8(&mut text[out..out + len]);
    Some((end, out + len))
}

/// Parses a whole body; `None` if it is not strict JSON in UTF-8 (or nests too deep). `wide`:
/// scan with AVX2 where the CPU has it.
fn parse<'a>(
    body: &'a [u8],
    decoded: &'a mut Vec<u8>,
    tree: &'a mut Tree,
    wide: bool,
) -> Option<Doc<'a>> {
    if body.len() >= 1 << 31 {
        return None; // beyond `Span`'s offsets
    }
    tree.clear();
    let mut p = Parser {
        bytes: body,
        pos: 0,
        text: decoded,
        filled: 0,
        tree,
        wide: wide && wide_lanes(), // what makes `Parser::string`'s AVX2 call sound
    };
    let root = p.value(0)?;
    p.skip_ws();
    let end = p.pos;
    let (text, filled): (&'a Vec<u8>, usize) = (p.text, p.filled);
    let tree: &'a Tree = p.tree;
    (end == body.len()).then_some(Doc {
        root,
        body,
        text: &text[..filled],
        items: &tree.items,
        members: &tree.members,
    })
}

// ---- the reference's compact JSON (orjson, sorted keys) --------------------------------

/// Appends `s` as orjson writes a string: quotes, backslashes and control characters escaped
/// (the short forms where JSON has them, else `\u00xx`), everything else as it is.
fn write_json_str(out: &mut Vec<u8>, s: &[u8]) {
    out.push(b'"');
    let mut run = 0;
    loop {
        // The bytes to escape are the ones a string scan stops at: runs between them are
        // found a chunk at a time and copied whole (tools' schemas have long descriptions).
        let stop = clean_run::<false>(s, run, &mut 0);
        copy::append(out, &s[run..stop]);
        let Some(&b) = s.get(stop) else { break };
        run = stop + 1;
        let short = match b {
            b'"' => b'"',
            b'\\' => b'\\',
            b'\n' => b'n',
            b'\r' => b'r',
            b'\t' => b't',
            0x08 => b'b',
            0x0c => b'f',
            _ => 0,
        };
        if short == 0 {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 0xf)]);
        } else {
            out.push(b'\\');
            out.push(short);
        }
    }
    out.push(b'"');
}

/// Appends a string of the body as orjson writes it. One without escapes in the body is written
/// as it is there: it has no byte that orjson escapes (a string scan stops at each of them, and
/// JSON allows them only escaped).
fn write_str(doc: &Doc<'_>, out: &mut Vec<u8>, s: Span) {
    if s.decoded() {
        write_json_str(out, doc.str(s));
    } else {
        out.push(b'"');
        copy::append(out, doc.str(s));
        out.push(b'"');
    }
}

/// Appends `v` as `orjson.dumps(v, option=OPT_SORT_KEYS)` writes the parsed value; `None` for a
/// float (whose shortest-repr formatting is the reference's business) or an integer beyond
/// 64 bits.
fn write_compact(doc: &Doc<'_>, out: &mut Vec<u8>, order: &mut Vec<u32>, v: &Value) -> Option<()> {
    match *v {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(lit) => {
            let lit = doc.str(lit);
            // An integer the reference reads as one; its literal is its shortest form but for a
            // negative zero.
            int_literal(lit)?;
            out.extend_from_slice(if lit == b"-0" { b"0" } else { lit });
        }
        Value::Str(s) => write_str(doc, out, s),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in doc.items(items).iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_compact(doc, out, order, item)?;
            }
            out.push(b']');
        }
        Value::Object(members) => {
            // The members' order, sorted, on top of `order` (a nested object's goes above it
            // meanwhile, and is gone again when it is written). Stable: among equal keys the
            // last one stays last, and it is the dict's value. UTF-8 byte order is code point
            // order, which is how the reference sorts.
            let members = doc.members(members);
            let base = order.len();
            order.extend(0..members.len() as u32);
            order[base..].sort_by(|&a, &b| {
                doc.str(members[a as usize].0)
                    .cmp(doc.str(members[b as usize].0))
            });
            out.push(b'{');
            let mut first = true;
            for i in base..order.len() {
                let (span, value) = members[order[i] as usize];
                let key = doc.str(span);
                if order
                    .get(i + 1)
                    .is_some_and(|&next| doc.str(members[next as usize].0) == key)
                {
                    continue;
                }
                if !first {
                    out.push(b',');
                }
                first = false;
                write_str(doc, out, span);
                out.push(b':');
                write_compact(doc, out, order, &value)?;
            }
            order.truncate(base);
            out.push(b'}');
        }
    }
    Some(())
}

// ---- the APIs ----------------------------------------------------------------------------

/// A `max_tokens`-like limit: absent/null is `Some(None)`; a non-negative integer is the limit;
/// anything else is the reference's (it rejects it).
fn limit(doc: &Doc<'_>, v: Option<&Value>) -> Option<Option<u64>> {
    match v {
        None | Some(Value::Null) => Some(None),
        Some(&Value::Number(lit)) => Some(Some(u64::try_from(int_literal(doc.str(lit))?).ok()?)),
        Some(_) => None,
    }
}

/// Token ids (ints in 0..2**32), from a non-empty list.
fn token_list(doc: &Doc<'_>, items: &[Value]) -> Option<Vec<u32>> {
    if items.is_empty() {
        return None;
    }
    items
        .iter()
        .map(|t| match *t {
            Value::Number(lit) => u32::try_from(int_literal(doc.str(lit))?).ok(),
            _ => None,
        })
        .collect()
}

/// The chat serialization as it is put together: strings of the body (or decoded from it) by
/// reference where they are long, the rest (tags, short strings, compact JSON) written into
/// `text`, each run of it a piece.
struct Serial<'a, 't> {
    pieces: Vec<Piece<'a>>,
    text: &'t mut Vec<u8>,
    /// Where in `text` the run not yet in `pieces` starts.
    run: usize,
    /// `write_compact`'s stack of members in key order.
    order: Vec<u32>,
}

enum Piece<'a> {
    Borrowed(&'a [u8]),
    Written(std::ops::Range<usize>),
}

impl<'a> Serial<'a, '_> {
    /// Strings shorter than this are copied: a piece of their own would cost more than that.
    const SHORT: usize = 256;

    fn put(&mut self, s: &'a [u8]) {
        if s.len() < Self::SHORT {
            self.text.extend_from_slice(s);
            return;
        }
        self.close_run();
        self.pieces.push(Piece::Borrowed(s));
    }

    fn close_run(&mut self) {
        if self.text.len() > self.run {
            self.pieces.push(Piece::Written(self.run..self.text.len()));
            self.run = self.text.len();
        }
    }

    /// Appends `v` as compact JSON (`write_compact`).
    fn compact(&mut self, doc: &Doc<'_>, v: &Value) -> Option<()> {
        write_compact(doc, self.text, &mut self.order, v)
    }
}

/// Appends a message's content as the reference's `_content_text` renders it.
fn content_text<'a>(
    doc: &Doc<'a>,
    out: &mut Serial<'a, '_>,
    content: Option<&Value>,
) -> Option<()> {
    match content {
        None | Some(Value::Null) => {}
        Some(&Value::Str(s)) => out.put(doc.str(s)),
        Some(&Value::Array(parts)) => {
            for part in doc.items(parts) {
                let text = match part {
                    Value::Object(_) => {
                        let kind = doc.get(part, b"type");
                        if !kind.is_none_or(|t| doc.is_str(t, b"text")) {
                            continue; // images, audio: not keyed
                        }
                        doc.get(part, b"text")?
                    }
                    other => other,
                };
                let &Value::Str(s) = text else { return None };
                out.put(doc.str(s));
            }
        }
        Some(other) => out.compact(doc, other)?,
    }
    Some(())
}

/// Puts the chat serialization together in `out`; returns whether it is a first turn.
fn chat<'a>(doc: &Doc<'a>, out: &mut Serial<'a, '_>) -> Option<bool> {
    let Some(&Value::Array(messages)) = doc.get(&doc.root, b"messages") else {
        return None;
    };
    let messages = doc.items(messages);
    if messages.is_empty() {
        return None;
    }
    let mut roles = Vec::with_capacity(messages.len());
    for m in messages {
        let Some(&Value::Str(role)) = doc.get(m, b"role") else {
            return None;
        };
        roles.push(doc.str(role));
    }
    match doc.get(&doc.root, b"tools") {
        None | Some(Value::Null) => {}
        Some(tools @ &Value::Array(items)) => {
            if !items.is_empty() {
                out.text.extend_from_slice(b"<|tools|>");
                out.compact(doc, tools)?;
                out.text.push(b'\n');
            }
        }
        Some(_) => return None,
    }
    for (m, role) in messages.iter().zip(&roles) {
        out.text.extend_from_slice(b"<|");
        out.text.extend_from_slice(role);
        out.text.extend_from_slice(b"|>");
        content_text(doc, out, doc.get(m, b"content"))?;
        if let Some(calls) = doc.get(m, b"tool_calls") {
            if doc.truthy(calls)? {
                out.text.extend_from_slice(b"<|calls|>");
                out.compact(doc, calls)?;
            }
        }
        match doc.get(m, b"tool_call_id") {
            None | Some(Value::Null | Value::Bool(false)) => {}
            Some(&Value::Str(id)) => {
                if !id.is_empty() {
                    out.text.extend_from_slice(b"<|id|>");
                    out.put(doc.str(id));
                }
            }
            Some(_) => return None, // str() of anything else is the reference's
        }
        out.text.push(b'\n');
    }
    Some(!roles.iter().any(|r| *r == b"assistant" || *r == b"tool"))
}

fn generate(doc: Doc<'_>) -> Option<(Prompt<'_>, Option<u64>)> {
    let root = &doc.root;
    let params = match doc.get(root, b"sampling_params") {
        Some(p @ Value::Object(_)) => Some(p),
        None => None,
        Some(falsy) if !doc.truthy(falsy)? => None, // `or {}`
        Some(_) => return None,
    };
    let max_new = limit(&doc, params.and_then(|p| doc.get(p, b"max_new_tokens")))?;
    let prompt = match (
        doc.get_some(root, b"text"),
        doc.get_some(root, b"input_ids"),
    ) {
        (Some(text), None) => {
            let text = match *text {
                Value::Array(items)
                    if !items.is_empty()
                        && doc.items(items).iter().all(|t| matches!(t, Value::Str(_))) =>
                {
                    &doc.items(items)[0]
                }
                _ => text,
            };
            let &Value::Str(s) = text else { return None };
            Prompt::Text(doc.str(s))
        }
        (None, Some(ids)) => {
            let ids = match *ids {
                Value::Array(items)
                    if matches!(doc.items(items).first(), Some(Value::Array(_))) =>
                {
                    &doc.items(items)[0]
                }
                _ => ids,
            };
            let &Value::Array(ids) = ids else { return None };
            Prompt::Tokens(token_list(&doc, doc.items(ids))?)
        }
        _ => return None,
    };
    Some((prompt, max_new))
}

fn completions(doc: Doc<'_>) -> Option<(Prompt<'_>, Option<u64>)> {
    let max_new = limit(&doc, doc.get(&doc.root, b"max_tokens"))?;
    let prompt = match *doc.get(&doc.root, b"prompt")? {
        Value::Str(s) => Prompt::Text(doc.str(s)),
        Value::Array(items) => {
            let items = doc.items(items);
            match *items.first()? {
                Value::Str(s) => Prompt::Text(doc.str(s)),
                Value::Number(_) => Prompt::Tokens(token_list(&doc, items)?),
                _ => return None,
            }
        }
        _ => return None,
    };
    Some((prompt, max_new))
}

/// What the reference would make of `body` for `api`, or `None` where the reference must decide
/// (including every body it rejects).
pub fn view_body<'a>(api: Api, body: &'a [u8], scratch: &'a mut Scratch) -> Option<BodyView<'a>> {
    view_body_lanes(api, body, scratch, true)
}

/// `view_body`, its strings scanned with AVX2 where `wide` and the CPU has it, else not.
fn view_body_lanes<'a>(
    api: Api,
    body: &'a [u8],
    scratch: &'a mut Scratch,
    wide: bool,
) -> Option<BodyView<'a>> {
    let Scratch {
        decoded,
        text,
        tree,
    } = scratch;
    let doc = parse(body, decoded, tree, wide)?;
    if !matches!(doc.root, Value::Object(_)) {
        return None;
    }
    let stream = match doc.get(&doc.root, b"stream") {
        None => false,
        Some(s) => doc.truthy(s)?,
    };
    let (prompt, max_new_tokens, is_first_turn) = match api {
        Api::Chat => {
            text.clear();
            let mut serial = Serial {
                pieces: Vec::new(),
                text,
                run: 0,
                order: Vec::new(),
            };
            let first = chat(&doc, &mut serial)?;
            serial.close_run();
            let Serial { pieces, text, .. } = serial;
            let text: &'a Vec<u8> = text;
            let pieces = pieces
                .into_iter()
                .map(|piece| match piece {
                    Piece::Borrowed(s) => s,
                    Piece::Written(range) => &text[range],
                })
                .collect();
            let max_new = match doc.get(&doc.root, b"max_completion_tokens") {
                Some(value) => limit(&doc, Some(value))?,
                None => limit(&doc, doc.get(&doc.root, b"max_tokens"))?,
            };
            (Prompt::Pieces(pieces), max_new, Some(first))
        }
        Api::Generate => {
            let (prompt, max_new) = generate(doc)?;
            (prompt, max_new, None)
        }
        Api::Completions => {
            let (prompt, max_new) = completions(doc)?;
            (prompt, max_new, None)
        }
    };
    Some(BodyView {
        prompt,
        max_new_tokens,
        stream,
        is_first_turn,
    })
}

/// A JSON object's body with `members` (members, without braces: PD's bootstrap fields) put
/// last, so that they override any the body has (JSON parsers keep a key's last value), and the
/// rest byte for byte; None if the body is not an object.
pub fn inject_members(raw: &[u8], members: &[u8]) -> Option<Vec<u8>> {
    let start = raw.iter().position(|b| !b.is_ascii_whitespace())?;
    let end = raw.iter().rposition(|b| !b.is_ascii_whitespace())?;
    if raw[start] != b'{' || raw[end] != b'}' || end == start {
        return None;
    }
    let empty = raw[start + 1..]
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|&b| b == b'}');
    let mut body = Vec::with_capacity(raw.len() + members.len() + 1);
    crate::copy::append(&mut body, &raw[..end]);
    if !empty {
        body.push(b',');
    }
    body.extend_from_slice(members);
    body.extend_from_slice(&raw[end..]);
    Some(body)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Both string scans this CPU has: AVX2 where it has it, and SSE2 (or the portable loop).
    fn lanes() -> Vec<bool> {
        if wide_lanes() {
            vec![true, false]
        } else {
            vec![false]
        }
    }

    /// `view_body` with a scratch of its own (kept, so that the view may outlive the call);
    /// the view of each scan `lanes` has, checked to be the same.
    fn view_body(api: Api, body: &[u8]) -> Option<BodyView<'_>> {
        let views: Vec<_> = lanes()
            .into_iter()
            .map(|wide| view_body_lanes(api, body, Box::leak(Box::default()), wide))
            .collect();
        assert!(views.iter().all(|v| *v == views[0]), "the scans disagree");
        views.into_iter().next().expect("a scan")
    }

    fn text(api: Api, body: &str) -> Vec<u8> {
        match view_body(api, body.as_bytes()).expect("fast path").prompt {
            Prompt::Text(t) => t.to_vec(),
            Prompt::Pieces(pieces) => pieces.concat(),
            Prompt::Tokens(_) => panic!("expected text"),
        }
    }

    #[test]
    fn chat_serializes_tools_and_messages_like_the_reference() {
        let body = r#"{"tools":[{"z":1,"a":{"y":null,"b":[true,false]}}],
            "messages":[{"role":"system","content":"be \"brief\"\n"},
                        {"role":"user","content":[{"type":"text","text":"a"},
                                                  {"type":"image_url","image_url":{}},
                                                  "b"]},
                        {"role":"assistant","content":null,
                         "tool_calls":[{"id":"c1","function":{"name":"f"}}]},
                        {"role":"tool","content":"ok","tool_call_id":"c1"}]}"#;
        let expected = concat!(
            "<|tools|>[{\"a\":{\"b\":[true,false],\"y\":null},\"z\":1}]\n",
            "<|system|>be \"brief\"\n\n",
            "<|user|>ab\n",
            "<|assistant|><|calls|>[{\"function\":{\"name\":\"f\"},\"id\":\"c1\"}]\n",
            "<|tool|>ok<|id|>c1\n",
        );
        assert_eq!(String::from_utf8(text(Api::Chat, body)).unwrap(), expected);
        let view = view_body(Api::Chat, body.as_bytes()).unwrap();
        assert_eq!(view.is_first_turn, Some(false));
        assert_eq!(view.max_new_tokens, None);
        assert!(!view.stream);
    }

    #[test]
    fn escapes_decode_and_serialized_strings_escape_as_orjson_does() {
        let body = r#"{"messages":[{"role":"u\u0073er","content":"\u00e9\ud83d\ude00\/\t"}],
                       "tools":[{"d":"\u0001\b\u007f\u00e9"}]}"#;
        let expected = "<|tools|>[{\"d\":\"\\u0001\\b\u{7f}é\"}]\n<|user|>é😀/\t\n";
        assert_eq!(String::from_utf8(text(Api::Chat, body)).unwrap(), expected);
    }

    #[test]
    fn tools_are_written_as_compact_json_with_sorted_keys() {
        // Nested objects sorted at each level (the last of a repeated key kept), integers as
        // Python writes them (`-0` is 0), strings with escapes written back in orjson's form.
        let body = r#"{"messages":[{"role":"user","content":"q"}],
            "tools":[{"z":{"b":-0,"a":[1,-2,{"y":1,"x":"\u0041\/"}]},"a":1,"a":2}]}"#;
        let expected = r#"<|tools|>[{"a":2,"z":{"a":[1,-2,{"x":"A/","y":1}],"b":0}}]"#;
        assert_eq!(
            String::from_utf8(text(Api::Chat, body)).unwrap(),
            format!("{expected}\n<|user|>q\n")
        );
    }

    #[test]
    fn a_chat_s_long_strings_stay_where_they_are() {
        let long = "x".repeat(300);
        let escaped = "y\\n".repeat(200);
        let body = format!(
            r#"{{"messages":[{{"role":"system","content":"{long}"}},{{"role":"user","content":"{escaped}"}},{{"role":"user","content":"short"}}]}}"#
        );
        let view = view_body(Api::Chat, body.as_bytes()).unwrap();
        let Prompt::Pieces(pieces) = view.prompt else {
            panic!("chat comes in pieces")
        };
        let decoded = "y\n".repeat(200);
        let expected: [&[u8]; 5] = [
            b"<|system|>",
            long.as_bytes(),
            b"\n<|user|>",
            decoded.as_bytes(),
            b"\n<|user|>short\n",
        ];
        assert_eq!(pieces, expected);
        // The first long string is the body's own bytes; the second, decoded, is not.
        assert!(body.as_bytes().as_ptr_range().contains(&pieces[1].as_ptr()));
        assert!(!body.as_bytes().as_ptr_range().contains(&pieces[3].as_ptr()));
    }

    #[test]
    fn duplicate_keys_take_the_last_value() {
        let body = r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":5,"max_tokens":7,
                       "tools":[{"k":1,"k":2}]}"#;
        let view = view_body(Api::Chat, body.as_bytes()).unwrap();
        assert_eq!(view.max_new_tokens, Some(7));
        assert_eq!(
            view.prompt,
            Prompt::Pieces(vec![b"<|tools|>[{\"k\":2}]\n<|user|>x\n"])
        );
    }

    #[test]
    fn generate_and_completions_take_text_or_token_ids() {
        let v = view_body(
            Api::Generate,
            br#"{"input_ids":[[1,2,3],[4]],"sampling_params":{"max_new_tokens":9},"stream":1}"#,
        )
        .unwrap();
        assert_eq!(v.prompt, Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(
            (v.max_new_tokens, v.stream, v.is_first_turn),
            (Some(9), true, None)
        );
        let v = view_body(
            Api::Completions,
            br#"{"prompt":["hi","there"],"max_tokens":0}"#,
        )
        .unwrap();
        assert_eq!(v.prompt, Prompt::Text(b"hi"));
        assert_eq!(v.max_new_tokens, Some(0));
    }

    #[test]
    fn what_the_reference_must_decide_is_left_to_it() {
        for (api, body) in [
            (Api::Chat, r#"{"messages":[]}"#),
            (
                Api::Chat,
                r#"{"messages":[{"role":"user"}],"max_tokens":-1}"#,
            ),
            (
                Api::Chat,
                r#"{"messages":[{"role":"user"}],"max_tokens":1.0}"#,
            ),
            (Api::Chat, r#"{"messages":[{"role":"user","content":1.5}]}"#),
            (
                Api::Chat,
                r#"{"messages":[{"role":"user","content":"\ud800"}]}"#,
            ),
            (Api::Chat, r#"{"messages":[{"role":"user"}]} x"#),
            (
                Api::Chat,
                r#"{"messages":[{"role":"user","content":"a	b"}]}"#,
            ),
            (Api::Generate, r#"{"text":"a","input_ids":[1]}"#),
            (Api::Generate, r#"{"input_ids":[4294967296]}"#),
            (Api::Generate, r#"{"input_ids":[true]}"#),
            (Api::Completions, r#"{"prompt":NaN}"#),
            (Api::Completions, r#"[1]"#),
        ] {
            assert_eq!(view_body(api, body.as_bytes()), None, "{body}");
        }
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let body = format!(r#"{{"prompt":"p","x":{deep}}}"#);
        assert_eq!(view_body(Api::Completions, body.as_bytes()), None);
        // Bytes beyond ASCII must be UTF-8, in a scanned chunk or in the body's last bytes.
        assert_eq!(view_body(Api::Completions, b"{\"prompt\":\"\xff\"}"), None);
        let mut long = br#"{"prompt":""#.to_vec();
        long.extend(b"a".repeat(40));
        long.extend(b"\xc3\x28"); // a lead byte without its continuation
        long.extend(b"a".repeat(40));
        long.extend(br#""}"#);
        assert_eq!(view_body(Api::Completions, &long), None);
        assert_eq!(view_body(Api::Completions, b"{\"prompt\":\"a\"}\xff"), None);
        assert!(view_body(Api::Completions, "{\"prompt\":\"é\"}".as_bytes()).is_some());
    }

    #[test]
    fn strings_without_escapes_stay_in_the_body_and_others_decode_whole() {
        fn prompt(api: Api, body: &str) -> Prompt<'_> {
            view_body(api, body.as_bytes()).expect("fast path").prompt
        }
        let body = r#"{"sampling_params":{"stop":"a\nb"},"text":"plain","stream":true}"#;
        let Prompt::Text(plain) = prompt(Api::Generate, body) else {
            panic!("a text prompt")
        };
        assert_eq!(plain, b"plain");
        assert!(body.as_bytes().as_ptr_range().contains(&plain.as_ptr()));
        // A prompt with escapes after other decoded strings (here a key, too).
        let body = r#"{"sampling_params":{"stop":"a\nb"},"te\u0078t":"x\ty\"z\u00e9"}"#;
        assert_eq!(
            prompt(Api::Generate, body),
            Prompt::Text("x\ty\"z\u{e9}".as_bytes())
        );
        let body = r#"{"prompt":["p\/q","r"],"max_tokens":3}"#;
        assert_eq!(prompt(Api::Completions, body), Prompt::Text(b"p/q"));
        // Runs of every length between escapes, and strings ending in the body's last bytes.
        for tail in ["", r"\n", r"ab\\"] {
            let content: String = (0..100).map(|n| "x".repeat(n) + r"\n").collect();
            let body = format!(r#"{{"max_tokens":1,"prompt":"{content}{tail}"}}"#);
            let expected = (content + tail).replace(r"\n", "\n").replace(r"\\", "\\");
            assert_eq!(text(Api::Completions, &body), expected.into_bytes());
        }
    }

    #[test]
    fn long_strings_cross_scan_chunks_intact() {
        let content: String = (0..500).map(|i| format!("line {i}: \u{e9}\\n")).collect();
        let body = format!(r#"{{"messages":[{{"role":"user","content":"{content}"}}]}}"#);
        let expected = format!("<|user|>{}\n", content.replace("\\n", "\n"));
        assert_eq!(text(Api::Chat, &body), expected.into_bytes());
    }

    /// `s` as JSON writes it, each character in one of the forms JSON allows for it, picked by
    /// `forms` (one number per character).
    fn encode(s: &[(char, u8)]) -> String {
        let mut out = String::new();
        for &(c, form) in s {
            let short = match c {
                '"' => Some('"'),
                '\\' => Some('\\'),
                '\n' => Some('n'),
                '\r' => Some('r'),
                '\t' => Some('t'),
                '\u{8}' => Some('b'),
                '\u{c}' => Some('f'),
                '/' if form % 2 == 0 => Some('/'),
                _ => None,
            };
            let must_escape = c == '"' || c == '\\' || c < ' ';
            match (short, form % 3) {
                (Some(e), 0 | 1) => {
                    out.push('\\');
                    out.push(e);
                }
                (_, 2) | (None, _) if must_escape || form % 3 == 2 => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        if form >= 128 {
                            out.push_str(&format!("\\u{unit:04X}"));
                        } else {
                            out.push_str(&format!("\\u{unit:04x}"));
                        }
                    }
                }
                _ => out.push(c),
            }
        }
        out
    }

    fn chars() -> impl Strategy<Value = Vec<(char, u8)>> {
        let special = prop::sample::select(vec![
            '"', '\\', '/', '\n', '\r', '\t', '\u{8}', '\u{c}', '\0', '\u{1f}', '\u{7f}', 'x', 'é',
            '€', '😀', '\u{2028}',
        ]);
        prop::collection::vec((prop_oneof![special, any::<char>()], any::<u8>()), 0..300)
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(2000))]

        /// Strings decode to what was encoded, whatever the escapes, their forms and
        /// spacing, and wherever the string ends relative to the body's end; a scratch used
        /// before (for a longer body) leaves nothing behind.
        #[test]
        fn strings_decode_to_what_was_encoded(
            prompt in chars(),
            other in chars(),
            pad in 0usize..80,
        ) {
            let text: String = prompt.iter().map(|&(c, _)| c).collect();
            let body = format!(
                r#"{{"k\u0065y":"{}","prompt":"{}","max_tokens":1}}{}"#,
                encode(&other),
                encode(&prompt),
                " ".repeat(pad)
            );
            let long = format!(r#"{{"prompt":"{}"}}"#, "\\n\\u00e9ab".repeat(200));
            for wide in lanes() {
                let mut scratch = Scratch::default();
                let used = view_body_lanes(Api::Completions, long.as_bytes(), &mut scratch, wide);
                assert!(used.is_some());
                let view = view_body_lanes(Api::Completions, body.as_bytes(), &mut scratch, wide);
                proptest::prop_assert_eq!(
                    view.map(|v| v.prompt),
                    Some(Prompt::Text(text.as_bytes())),
                    "{} (wide: {})",
                    body,
                    wide
                );
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(1000))]

        /// A string is written as orjson writes it, a character at a time: the short escapes
        /// where JSON has them, `\u00xx` for other control characters, everything else as it is.
        #[test]
        fn strings_are_written_as_orjson_writes_them(s in chars()) {
            let s: String = s.iter().map(|&(c, _)| c).collect();
            let mut expected = String::from("\"");
            for c in s.chars() {
                match c {
                    '"' => expected.push_str("\\\""),
                    '\\' => expected.push_str("\\\\"),
                    '\n' => expected.push_str("\\n"),
                    '\r' => expected.push_str("\\r"),
                    '\t' => expected.push_str("\\t"),
                    '\u{8}' => expected.push_str("\\b"),
                    '\u{c}' => expected.push_str("\\f"),
                    c if c < ' ' => expected.push_str(&format!("\\u{:04x}", c as u32)),
                    c => expected.push(c),
                }
            }
            expected.push('"');
            let mut out = b"before".to_vec();
            write_json_str(&mut out, s.as_bytes());
            proptest::prop_assert_eq!(&out[..6], b"before");
            proptest::prop_assert_eq!(String::from_utf8(out[6..].to_vec()).unwrap(), expected);
        }
    }

    #[test]
    fn bad_utf8_after_an_escape_is_left_to_the_reference() {
        // Past the first escape the string is decoded; bytes beyond ASCII there must still be
        // checked, in the chunked loop and in the body's last bytes alike.
        for pad in [0, 100] {
            let mut body = b"{\"prompt\":\"".to_vec();
            body.extend_from_slice(&b"a\\n".repeat(40));
            body.extend_from_slice(b"\xff\xfe");
            body.extend_from_slice(&b"b".repeat(pad));
            body.extend_from_slice(b"\"}");
            assert_eq!(view_body(Api::Completions, &body), None, "pad {pad}");
            // The same body with valid UTF-8 there is read.
            let valid = String::from_utf8_lossy(&body).into_owned();
            assert!(view_body(Api::Completions, valid.as_bytes()).is_some());
        }
    }

    #[test]
    fn a_raw_control_character_anywhere_in_a_string_is_left_to_the_reference() {
        // JSON allows none in a string; each scan must stop at it, wherever it is in a chunk:
        // in a string without escapes, and before and after an escape in one with.
        fn body(content: &[u8]) -> Vec<u8> {
            let mut body = br#"{"max_tokens":1,"prompt":""#.to_vec();
            body.extend_from_slice(content);
            body.extend_from_slice(br#"","stream":false}"#);
            body
        }
        for control in [0x00, 0x0a, 0x1f] {
            for escape_at in [None, Some(0), Some(60)] {
                for at in 0..100 {
                    let mut content = vec![b'x'; 100];
                    if let Some(e) = escape_at {
                        if (e..e + 2).contains(&at) {
                            continue;
                        }
                        content[e..e + 2].copy_from_slice(b"\\n");
                    }
                    content[at] = b'y';
                    assert!(view_body(Api::Completions, &body(&content)).is_some());
                    content[at] = control;
                    let bad = body(&content);
                    assert_eq!(view_body(Api::Completions, &bad), None, "{control} at {at}");
                }
            }
        }
    }

    #[test]
    fn a_body_cut_anywhere_is_left_to_the_reference() {
        // Escapes of every kind near every possible end, in long strings: no cut may panic, and
        // no cut body is JSON.
        let content = "x\\n\\u00e9\\ud83d\\ude00\\\"y\\\\".repeat(12);
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"{content}"}},{{"role":"tool","content":"{content}","tool_call_id":"t\u0031"}}],"max_tokens":3}}"#
        );
        assert!(view_body(Api::Chat, body.as_bytes()).is_some());
        for wide in lanes() {
            let mut scratch = Scratch::default();
            for cut in 0..body.len() {
                assert_eq!(
                    view_body_lanes(Api::Chat, &body.as_bytes()[..cut], &mut scratch, wide),
                    None,
                    "cut at {cut} (wide: {wide})"
                );
            }
        }
    }

    #[test]
    fn inject_members_puts_them_last_and_keeps_the_rest_byte_for_byte() {
        let m = br#""a": 1"#;
        let inject = |raw: &[u8]| inject_members(raw, m);
        assert_eq!(
            inject(b" {\"x\" : [1,2]} \n").as_deref(),
            Some(&b" {\"x\" : [1,2],\"a\": 1} \n"[..])
        );
        assert_eq!(inject(b"{}").as_deref(), Some(&b"{\"a\": 1}"[..]));
        assert_eq!(inject(b"{ \t}").as_deref(), Some(&b"{ \t\"a\": 1}"[..]));
        assert_eq!(
            inject(b"{\"y\":{}}").as_deref(),
            Some(&b"{\"y\":{},\"a\": 1}"[..])
        );
        for raw in [&b"[1]"[..], b"  ", b"", b"{", b"}", b"{\"y\":1"] {
            assert_eq!(inject(raw), None);
        }
    }
}
