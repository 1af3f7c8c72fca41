//! The prefix index: one radix tree over chained block keys, shared by every instance, each node
//! annotated with the instances that hold it.
//!
//! * A node is a run of block keys (an edge of the radix tree). Each instance holds a node whole
//!   or not at all; partial holdings are made whole by splitting the node.
//! * Holdings are prefix-closed: an instance that holds a node holds all its ancestors. That is
//!   what a KV cache holds (a page is useless without the pages before it), and it makes a match
//!   one walk down the tree: an instance's match length is the depth where it last appears.
//! * Every block key is in one hash table, key -> (node, offset) (`KeyTable`). Walking uses it to
//!   step from node to child; `remove` uses it to find a block named only by its key (as KV
//!   events name them). Loops over a run of keys prefetch the table a few keys ahead.
//! * LRU per instance, evicting leaves first. A touch stamps every node of the path with the same
//!   clock tick; ties order deeper nodes first. So a parent is never older than its child, the
//!   least recent node of an instance is one of its leaves, and eviction keeps holdings
//!   prefix-closed. Each instance keeps a lazy min-heap of (stamp, node): touching a node only
//!   rewrites its stamp, and a stale heap entry is re-pushed with the fresh stamp when popped.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fmt;

use crate::keytable::KeyTable;

/// The reserved name of the shared global KV tier (a Mooncake-style store). It is an instance like
/// any other (capacity, LRU), but it is listed and matched apart from the GPU instances.
pub const GLOBAL_TIER: &str = "@global";

const ROOT: u32 = 0;
const NONE: u32 = u32::MAX;

type Slot = u16;

#[derive(Clone, Copy, Debug)]
struct Holder {
    slot: Slot,
    /// Clock tick of the last touch.
    time: u64,
    /// The stamp of this holder's one live heap entry.
    heap_time: u64,
}

#[derive(Debug)]
struct Node {
    keys: Vec<u64>,
    parent: u32,
    /// Blocks above this node (its first block's position in a prompt).
    depth: u32,
    first_child: u32,
    prev_sibling: u32,
    next_sibling: u32,
    holders: Vec<Holder>,
    /// Bumped when the node is freed, so heap entries naming an older node are ignored.
    generation: u32,
    alive: bool,
}

impl Node {
    fn empty() -> Self {
        Node {
            keys: Vec::new(),
            parent: NONE,
            depth: 0,
            first_child: NONE,
            prev_sibling: NONE,
            next_sibling: NONE,
            holders: Vec::new(),
            generation: 0,
            alive: false,
        }
    }

    fn holder(&self, slot: Slot) -> Option<usize> {
        self.holders.iter().position(|h| h.slot == slot)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
struct HeapEntry {
    time: u64,
    /// `u32::MAX - depth`: on equal time the deeper node is older, so leaves go first.
    inv_depth: u32,
    node: u32,
    generation: u32,
}

#[derive(Debug)]
struct Instance {
    name: String,
    capacity_blocks: u64,
    blocks: u64,
    nodes: u64,
    evicted_blocks: u64,
    heap: BinaryHeap<Reverse<HeapEntry>>,
}

/// What went wrong; the index is unchanged when an operation returns one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexError {
    UnknownInstance(String),
    DuplicateInstance(String),
    InvalidName(String),
    TooManyInstances,
    /// A key of the new part of a prompt is already in the index under a different prefix: the
    /// keys were not chained (or two chains collided).
    KeyConflict {
        position: usize,
    },
}

impl fmt::Display for IndexError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IndexError::UnknownInstance(n) => write!(f, "unknown instance {n:?}"),
            IndexError::DuplicateInstance(n) => write!(f, "instance {n:?} already exists"),
            IndexError::InvalidName(why) => write!(f, "invalid instance name: {why}"),
            IndexError::TooManyInstances => write!(f, "too many instances (at most 65535)"),
            IndexError::KeyConflict { position } => write!(
                f,
                "block key at position {position} is already indexed under a different prefix \
                 (keys must be chained: build them with hash_text, hash_tokens or from_ids)"
            ),
        }
    }
}

impl std::error::Error for IndexError {}

/// Per-instance counters, as `stats` reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceStats {
    pub name: String,
    pub blocks: u64,
    pub capacity_blocks: u64,
    pub nodes: u64,
    pub evicted_blocks: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexStats {
    /// GPU instances in add order; the global tier apart.
    pub instances: Vec<InstanceStats>,
    pub global: Option<InstanceStats>,
    pub nodes: u64,
    pub unique_blocks: u64,
    /// Heap bytes held by the index's structures (an estimate from capacities).
    pub bytes_used: u64,
}

/// One match: the leading blocks each instance holds, in `instances()` order, plus the global tier.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MatchResult {
    pub blocks: Vec<u32>,
    pub global_blocks: u32,
}

#[derive(Debug)]
pub struct PrefixIndex {
    nodes: Vec<Node>,
    free: Vec<u32>,
    live_nodes: u64,
    map: KeyTable,
    slots: Vec<Option<Instance>>,
    /// GPU instances in add order (the dense order of match results).
    order: Vec<Slot>,
    names: HashMap<String, Slot>,
    global: Option<Slot>,
    clock: u64,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new()
    }
}

fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    let n = a.len().min(b.len());
    if a[..n] == b[..n] {
        return n;
    }
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixIndex {
    pub fn new() -> Self {
        let mut root = Node::empty();
        root.alive = true;
        PrefixIndex {
            nodes: vec![root],
            free: Vec::new(),
            live_nodes: 0,
            map: KeyTable::default(),
            slots: Vec::new(),
            order: Vec::new(),
            names: HashMap::new(),
            global: None,
            clock: 0,
        }
    }

    // ---- instances ------------------------------------------------------------------------

    /// Adds an instance; `GLOBAL_TIER` adds the global tier.
    pub fn add_instance(&mut self, name: &str, capacity_blocks: u64) -> Result<(), IndexError> {
        if name.is_empty() {
            return Err(IndexError::InvalidName("empty".into()));
        }
        if self.names.contains_key(name) {
            return Err(IndexError::DuplicateInstance(name.into()));
        }
        let slot = match self.slots.iter().position(Option::is_none) {
            Some(free) => free,
            None if self.slots.len() < usize::from(Slot::MAX) => {
                self.slots.push(None);
                self.slots.len() - 1
            }
            None => return Err(IndexError::TooManyInstances),
        } as Slot;
        self.slots[usize::from(slot)] = Some(Instance {
            name: name.into(),
            capacity_blocks,
            blocks: 0,
            nodes: 0,
            evicted_blocks: 0,
            heap: BinaryHeap::new(),
        });
        self.names.insert(name.into(), slot);
        if name == GLOBAL_TIER {
            self.global = Some(slot);
        } else {
            self.order.push(slot);
        }
        Ok(())
    }

    /// Removes an instance and everything it holds; returns the blocks it held.
    pub fn remove_instance(&mut self, name: &str) -> Result<u64, IndexError> {
        let slot = self.slot(name)?;
        let dropped = self.clear_slot(slot);
        self.slots[usize::from(slot)] = None;
        self.names.remove(name);
        self.order.retain(|&s| s != slot);
        if self.global == Some(slot) {
            self.global = None;
        }
        Ok(dropped)
    }

    /// GPU instance names in add order: the order of `MatchResult::blocks`.
    pub fn instances(&self) -> Vec<String> {
        self.order
            .iter()
            .map(|&s| self.inst(s).name.clone())
            .collect()
    }

    pub fn has_instance(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    pub fn has_global_tier(&self) -> bool {
        self.global.is_some()
    }

    /// Evicts what `name` holds beyond its capacity (after `insert_over_capacity`); returns the
    /// blocks evicted.
    pub fn evict_to_capacity(&mut self, name: &str) -> Result<u64, IndexError> {
        let slot = self.slot(name)?;
        let before = self.inst(slot).evicted_blocks;
        self.evict(slot);
        self.compact_heap_if_needed(slot);
        Ok(self.inst(slot).evicted_blocks - before)
    }

    /// Changes a capacity, evicting at once if it shrinks; returns the blocks evicted.
    pub fn set_capacity(&mut self, name: &str, capacity_blocks: u64) -> Result<u64, IndexError> {
        let slot = self.slot(name)?;
        let before = self.inst(slot).evicted_blocks;
        self.inst_mut(slot).capacity_blocks = capacity_blocks;
        self.evict(slot);
        Ok(self.inst(slot).evicted_blocks - before)
    }

    fn slot(&self, name: &str) -> Result<Slot, IndexError> {
        self.names
            .get(name)
            .copied()
            .ok_or_else(|| IndexError::UnknownInstance(name.into()))
    }

    fn inst(&self, slot: Slot) -> &Instance {
        self.slots[usize::from(slot)].as_ref().expect("live slot")
    }

    fn inst_mut(&mut self, slot: Slot) -> &mut Instance {
        self.slots[usize::from(slot)].as_mut().expect("live slot")
    }

    // ---- the walk -----------------------------------------------------------------------

    /// Follows `keys` down the tree. Each step is (node, blocks of it matched); only the last step
    /// can be partial. Returns the number of blocks matched.
    fn walk(&self, keys: &[u64], path: &mut Vec<(u32, usize)>) -> usize {
        let mut parent = ROOT;
        let mut pos = 0;
        while pos < keys.len() {
            let Some((node, offset)) = self.map.get(keys[pos]) else {
                break;
            };
            let n = &self.nodes[node as usize];
            if offset != 0 || n.parent != parent {
                break; // the key lives under another prefix: a collision, not a match
            }
            let matched = common_prefix(&n.keys, &keys[pos..]);
            path.push((node, matched));
            pos += matched;
            if matched < n.keys.len() {
                break;
            }
            parent = node;
        }
        pos
    }

    /// The leading blocks of `keys` that are in the tree (held by some instance or the global
    /// tier): those an insert of `keys` walks rather than adds.
    pub fn known_prefix(&self, keys: &[u64]) -> usize {
        self.walk(keys, &mut Vec::new())
    }

    /// The leading blocks of `keys` each instance holds (no LRU touch).
    pub fn match_all(&self, keys: &[u64]) -> MatchResult {
        let mut path = Vec::new();
        self.walk(keys, &mut path);
        self.result_of(&path)
    }

    /// `match_all`, and the matched blocks of each instance count as just used (LRU).
    pub fn match_all_touch(&mut self, keys: &[u64]) -> MatchResult {
        let mut path = Vec::new();
        self.walk(keys, &mut path);
        self.clock += 1;
        let now = self.clock;
        self.split_partial_tail(&path);
        for &(node, _) in &path {
            for h in &mut self.nodes[node as usize].holders {
                h.time = now;
            }
        }
        self.result_of(&path)
    }

    fn result_of(&self, path: &[(u32, usize)]) -> MatchResult {
        let mut by_slot = vec![0u32; self.slots.len()];
        let mut depth = 0usize;
        for &(node, matched) in path {
            depth += matched;
            for h in &self.nodes[node as usize].holders {
                by_slot[usize::from(h.slot)] = depth as u32;
            }
        }
        MatchResult {
            blocks: self
                .order
                .iter()
                .map(|&s| by_slot[usize::from(s)])
                .collect(),
            global_blocks: self.global.map_or(0, |g| by_slot[usize::from(g)]),
        }
    }

    /// The path steps `slot` holds (a prefix of the path, holdings being prefix-closed).
    fn held_path(&self, slot: Slot, keys: &[u64]) -> Vec<(u32, usize)> {
        let mut path = Vec::new();
        self.walk(keys, &mut path);
        let held = path
            .iter()
            .take_while(|(node, _)| self.nodes[*node as usize].holder(slot).is_some())
            .count();
        path.truncate(held);
        path
    }

    /// The leading blocks of `keys` one instance holds (no LRU touch).
    pub fn match_instance(&self, name: &str, keys: &[u64]) -> Result<u32, IndexError> {
        let slot = self.slot(name)?;
        Ok(self
            .held_path(slot, keys)
            .iter()
            .map(|&(_, m)| m as u32)
            .sum())
    }

    /// `match_instance`, and the matched blocks count as just used by that instance (LRU).
    pub fn match_instance_touch(&mut self, name: &str, keys: &[u64]) -> Result<u32, IndexError> {
        let slot = self.slot(name)?;
        let path = self.held_path(slot, keys);
        self.clock += 1;
        let now = self.clock;
        self.split_partial_tail(&path);
        for &(node, _) in &path {
            let n = &mut self.nodes[node as usize];
            let i = n.holder(slot).expect("held path");
            n.holders[i].time = now;
        }
        Ok(path.iter().map(|&(_, m)| m as u32).sum())
    }

    /// Makes the last step of a path whole by splitting its node, so the path can be touched.
    fn split_partial_tail(&mut self, path: &[(u32, usize)]) {
        if let Some(&(node, matched)) = path.last() {
            if matched < self.nodes[node as usize].keys.len() {
                self.split(node, matched);
            }
        }
    }

    // ---- insert -------------------------------------------------------------------------

    /// Records that `name` now holds the prompt `keys` (all of it, as a cache does after serving
    /// it), touching the whole path, then evicts down to capacity. Returns the blocks newly held
    /// (before eviction).
    pub fn insert(&mut self, name: &str, keys: &[u64]) -> Result<u64, IndexError> {
        let added = self.insert_over_capacity(name, keys)?;
        self.evict_to_capacity(name)?;
        Ok(added)
    }

    /// `insert` without the eviction: `name` may be left holding more than its capacity, until
    /// `evict_to_capacity` or its next `insert`. A long prompt inserted in steps evicts once, at
    /// its last step: evicting at each step would take the least recent node a step's worth at a
    /// time, splitting it every time, where once takes it whole.
    pub fn insert_over_capacity(&mut self, name: &str, keys: &[u64]) -> Result<u64, IndexError> {
        let slot = self.slot(name)?;
        let mut path = Vec::new();
        let matched = self.walk(keys, &mut path);
        let new_keys = &keys[matched..];

        // Where the new blocks go: appended to the last node when only this instance holds it and
        // it has no children (a session's next turn), else a new child.
        let mut extend = None;
        if let Some(&(last, m)) = path.last() {
            let n = &self.nodes[last as usize];
            if m == n.keys.len()
                && n.first_child == NONE
                && n.holders.len() == 1
                && n.holders[0].slot == slot
            {
                extend = Some(last);
            }
        }
        let mut new_node = None;
        if !new_keys.is_empty() {
            let (target, base) = match extend {
                Some(last) => (last, self.nodes[last as usize].keys.len()),
                None => {
                    let id = self.alloc();
                    new_node = Some(id);
                    (id, 0)
                }
            };
            // Register the new keys first: a conflict rolls back before anything else changed.
            self.map.reserve(new_keys.len());
            for (i, &k) in new_keys.iter().enumerate() {
                self.map.prefetch_ahead(new_keys, i);
                if !self.map.insert_new(k, (target, (base + i) as u32)) {
                    for &k in &new_keys[..i] {
                        self.map.remove(k);
                    }
                    if let Some(id) = new_node {
                        self.release(id);
                    }
                    return Err(IndexError::KeyConflict {
                        position: matched + i,
                    });
                }
            }
        }

        self.clock += 1;
        let now = self.clock;
        self.split_partial_tail(&path);
        let mut added = 0u64;
        for &(node, _) in &path {
            added += self.hold(node, slot, now);
        }
        if let Some(last) = extend.filter(|_| !new_keys.is_empty()) {
            self.nodes[last as usize].keys.extend_from_slice(new_keys);
            let n = new_keys.len() as u64;
            self.inst_mut(slot).blocks += n;
            added += n;
        } else if let Some(id) = new_node {
            let parent = path.last().map_or(ROOT, |&(node, _)| node);
            let depth = matched as u32;
            let n = &mut self.nodes[id as usize];
            n.keys = new_keys.to_vec();
            n.depth = depth;
            self.link(id, parent);
            self.live_nodes += 1;
            added += self.hold(id, slot, now);
        }
        Ok(added)
    }

    /// Makes `slot` a holder of `node` stamped `now`; returns the blocks newly held.
    fn hold(&mut self, node: u32, slot: Slot, now: u64) -> u64 {
        let n = &mut self.nodes[node as usize];
        if let Some(i) = n.holder(slot) {
            n.holders[i].time = now;
            return 0;
        }
        n.holders.push(Holder {
            slot,
            time: now,
            heap_time: now,
        });
        let entry = HeapEntry {
            time: now,
            inv_depth: u32::MAX - n.depth,
            node,
            generation: n.generation,
        };
        let len = n.keys.len() as u64;
        let inst = self.inst_mut(slot);
        inst.heap.push(Reverse(entry));
        inst.blocks += len;
        inst.nodes += 1;
        len
    }

    // ---- tree surgery -------------------------------------------------------------------

    fn alloc(&mut self) -> u32 {
        match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize].alive = true;
                id
            }
            None => {
                let mut n = Node::empty();
                n.alive = true;
                self.nodes.push(n);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// Returns a node to the free list (its keys must already be out of the map).
    fn release(&mut self, id: u32) {
        let n = &mut self.nodes[id as usize];
        let generation = n.generation.wrapping_add(1);
        *n = Node::empty();
        n.generation = generation;
        self.free.push(id);
    }

    fn link(&mut self, child: u32, parent: u32) {
        let head = self.nodes[parent as usize].first_child;
        {
            let c = &mut self.nodes[child as usize];
            c.parent = parent;
            c.prev_sibling = NONE;
            c.next_sibling = head;
        }
        if head != NONE {
            self.nodes[head as usize].prev_sibling = child;
        }
        self.nodes[parent as usize].first_child = child;
    }

    fn unlink(&mut self, child: u32) {
        let (parent, prev, next) = {
            let c = &self.nodes[child as usize];
            (c.parent, c.prev_sibling, c.next_sibling)
        };
        if prev == NONE {
            self.nodes[parent as usize].first_child = next;
        } else {
            self.nodes[prev as usize].next_sibling = next;
        }
        if next != NONE {
            self.nodes[next as usize].prev_sibling = prev;
        }
    }

    fn children(&self, node: u32) -> ChildIter<'_> {
        ChildIter {
            nodes: &self.nodes,
            next: self.nodes[node as usize].first_child,
        }
    }

    /// Splits `node` after `at` blocks. The head keeps the id (and so its parent link and
    /// heap entries); the tail is a new node that takes the children and a copy of the holders.
    fn split(&mut self, node: u32, at: usize) -> u32 {
        debug_assert!(at > 0 && at < self.nodes[node as usize].keys.len());
        let tail = self.alloc();
        let (tail_keys, holders, depth, first_child) = {
            let n = &mut self.nodes[node as usize];
            let tail_keys = n.keys.split_off(at);
            n.keys.shrink_to_fit();
            let first_child = std::mem::replace(&mut n.first_child, NONE);
            (
                tail_keys,
                n.holders.clone(),
                n.depth + at as u32,
                first_child,
            )
        };
        let mut child = first_child;
        while child != NONE {
            let c = &mut self.nodes[child as usize];
            c.parent = tail;
            child = c.next_sibling;
        }
        for (i, &k) in tail_keys.iter().enumerate() {
            self.map.prefetch_ahead(&tail_keys, i);
            let indexed = self.map.set(k, (tail, i as u32));
            assert!(indexed, "indexed key");
        }
        let generation = {
            let t = &mut self.nodes[tail as usize];
            t.keys = tail_keys;
            t.depth = depth;
            t.first_child = first_child;
            t.holders = holders
                .iter()
                .map(|h| Holder {
                    heap_time: h.time,
                    ..*h
                })
                .collect();
            t.generation
        };
        self.link(tail, node);
        self.live_nodes += 1;
        for h in holders {
            let inst = self.inst_mut(h.slot);
            inst.nodes += 1;
            inst.heap.push(Reverse(HeapEntry {
                time: h.time,
                inv_depth: u32::MAX - depth,
                node: tail,
                generation,
            }));
        }
        tail
    }

    /// `slot` stops holding `node`; a node nobody holds leaves the tree. Returns the blocks dropped.
    fn drop_holder(&mut self, node: u32, slot: Slot) -> u64 {
        let n = &mut self.nodes[node as usize];
        let Some(i) = n.holder(slot) else {
            return 0;
        };
        n.holders.swap_remove(i);
        let len = n.keys.len() as u64;
        let orphan = n.holders.is_empty();
        let inst = self.inst_mut(slot);
        inst.blocks -= len;
        inst.nodes -= 1;
        if orphan {
            // Holdings are prefix-closed, so a node nobody holds has no children left.
            debug_assert_eq!(self.nodes[node as usize].first_child, NONE);
            let keys = &self.nodes[node as usize].keys;
            for (i, &k) in keys.iter().enumerate() {
                self.map.prefetch_ahead(keys, i);
                self.map.remove(k);
            }
            self.unlink(node);
            self.release(node);
            self.live_nodes -= 1;
        }
        len
    }

    /// Drops `slot`'s holding of `top` and of everything below it; returns the blocks dropped.
    fn drop_subtree(&mut self, top: u32, slot: Slot) -> u64 {
        let mut preorder = Vec::new();
        let mut stack = vec![top];
        while let Some(node) = stack.pop() {
            preorder.push(node);
            stack.extend(
                self.children(node)
                    .filter(|&c| self.nodes[c as usize].holder(slot).is_some()),
            );
        }
        // Children before parents, so a node is childless by the time it may leave the tree.
        preorder
            .into_iter()
            .rev()
            .map(|node| self.drop_holder(node, slot))
            .sum()
    }

    // ---- eviction and removal -----------------------------------------------------------

    fn evict(&mut self, slot: Slot) {
        loop {
            let inst = self.inst_mut(slot);
            if inst.blocks <= inst.capacity_blocks {
                return;
            }
            let excess = inst.blocks - inst.capacity_blocks;
            let Some(Reverse(entry)) = inst.heap.pop() else {
                debug_assert!(false, "blocks held but no heap entry");
                return;
            };
            let n = &mut self.nodes[entry.node as usize];
            if !n.alive || n.generation != entry.generation {
                continue;
            }
            let Some(i) = n.holder(slot) else {
                continue;
            };
            let h = n.holders[i];
            if h.heap_time != entry.time {
                continue; // superseded by a newer entry for the same holder
            }
            if h.time != entry.time {
                // Touched since it was pushed: requeue at its real age.
                n.holders[i].heap_time = h.time;
                self.inst_mut(slot).heap.push(Reverse(HeapEntry {
                    time: h.time,
                    ..entry
                }));
                continue;
            }
            let len = n.keys.len() as u64;
            debug_assert!(
                self.children(entry.node)
                    .all(|c| self.nodes[c as usize].holder(slot).is_none()),
                "the least recent node must be a leaf"
            );
            let victim = if len > excess {
                // Evict only the deepest `excess` blocks; the head stays, with its entry.
                let tail = self.split(entry.node, (len - excess) as usize);
                self.inst_mut(slot).heap.push(Reverse(entry));
                tail
            } else {
                entry.node
            };
            let dropped = self.drop_holder(victim, slot);
            self.inst_mut(slot).evicted_blocks += dropped;
        }
    }

    /// Rebuilds an instance's heap when dead entries (from removals) outnumber live ones.
    fn compact_heap_if_needed(&mut self, slot: Slot) {
        let inst = self.inst(slot);
        let limit = 2 * inst.nodes + self.live_nodes / 4 + 64;
        if (inst.heap.len() as u64) <= limit {
            return;
        }
        let mut entries = Vec::with_capacity(inst.nodes as usize);
        for (id, n) in self.nodes.iter_mut().enumerate() {
            if !n.alive {
                continue;
            }
            if let Some(i) = n.holder(slot) {
                n.holders[i].heap_time = n.holders[i].time;
                entries.push(Reverse(HeapEntry {
                    time: n.holders[i].time,
                    inv_depth: u32::MAX - n.depth,
                    node: id as u32,
                    generation: n.generation,
                }));
            }
        }
        self.inst_mut(slot).heap = BinaryHeap::from(entries);
    }

    /// Drops the blocks named by `keys` from `name`, with everything `name` holds below them (a
    /// prefix cache cannot use a page whose parent is gone). Keys may come in any order and
    /// need not form a chain; unknown keys are skipped. Returns the blocks dropped.
    pub fn remove(&mut self, name: &str, keys: &[u64]) -> Result<u64, IndexError> {
        let slot = self.slot(name)?;
        let mut dropped = 0;
        for k in keys {
            let Some((node, offset)) = self.map.get(*k) else {
                continue;
            };
            if self.nodes[node as usize].holder(slot).is_none() {
                continue;
            }
            let top = if offset > 0 {
                self.split(node, offset as usize)
            } else {
                node
            };
            dropped += self.drop_subtree(top, slot);
        }
        self.compact_heap_if_needed(slot);
        Ok(dropped)
    }

    /// Drops everything `name` holds; returns the blocks dropped.
    pub fn clear(&mut self, name: &str) -> Result<u64, IndexError> {
        let slot = self.slot(name)?;
        Ok(self.clear_slot(slot))
    }

    fn clear_slot(&mut self, slot: Slot) -> u64 {
        let tops: Vec<u32> = self
            .children(ROOT)
            .filter(|&c| self.nodes[c as usize].holder(slot).is_some())
            .collect();
        let dropped = tops.into_iter().map(|t| self.drop_subtree(t, slot)).sum();
        self.inst_mut(slot).heap.clear();
        dropped
    }

    // ---- stats --------------------------------------------------------------------------

    fn instance_stats(&self, slot: Slot) -> InstanceStats {
        let i = self.inst(slot);
        InstanceStats {
            name: i.name.clone(),
            blocks: i.blocks,
            capacity_blocks: i.capacity_blocks,
            nodes: i.nodes,
            evicted_blocks: i.evicted_blocks,
        }
    }

    pub fn stats(&self) -> IndexStats {
        use std::mem::size_of;
        let mut bytes = self.nodes.capacity() * size_of::<Node>() + self.free.capacity() * 4;
        for n in &self.nodes {
            bytes += n.keys.capacity() * 8 + n.holders.capacity() * size_of::<Holder>();
        }
        bytes += self.map.bytes();
        for inst in self.slots.iter().flatten() {
            bytes += inst.heap.capacity() * size_of::<Reverse<HeapEntry>>() + inst.name.capacity();
        }
        IndexStats {
            instances: self.order.iter().map(|&s| self.instance_stats(s)).collect(),
            global: self.global.map(|g| self.instance_stats(g)),
            nodes: self.live_nodes,
            unique_blocks: self.map.len() as u64,
            bytes_used: bytes as u64,
        }
    }

    /// Checks every structural invariant; for tests.
    pub fn check_invariants(&self) {
        let mut blocks = vec![0u64; self.slots.len()];
        let mut nodes = vec![0u64; self.slots.len()];
        let mut live = 0;
        let mut keys = 0;
        for (id, n) in self.nodes.iter().enumerate() {
            if !n.alive || id == ROOT as usize {
                continue;
            }
            live += 1;
            keys += n.keys.len();
            assert!(!n.keys.is_empty(), "empty node {id}");
            assert!(!n.holders.is_empty(), "node {id} held by nobody");
            let parent = &self.nodes[n.parent as usize];
            assert!(parent.alive);
            assert!(self.children(n.parent).any(|c| c as usize == id));
            let parent_depth = if n.parent == ROOT {
                0
            } else {
                parent.depth + parent.keys.len() as u32
            };
            assert_eq!(n.depth, parent_depth, "depth of node {id}");
            for (i, k) in n.keys.iter().enumerate() {
                assert_eq!(self.map.get(*k), Some((id as u32, i as u32)));
            }
            for h in &n.holders {
                blocks[usize::from(h.slot)] += n.keys.len() as u64;
                nodes[usize::from(h.slot)] += 1;
                if n.parent != ROOT {
                    let ph = parent.holders.iter().find(|p| p.slot == h.slot);
                    let ph = ph.expect("holdings are prefix-closed");
                    assert!(ph.time >= h.time, "a parent is never older than its child");
                }
            }
        }
        assert_eq!(live, self.live_nodes);
        assert_eq!(keys, self.map.len());
        for (s, inst) in self.slots.iter().enumerate() {
            if let Some(inst) = inst {
                assert_eq!(inst.blocks, blocks[s], "blocks of {}", inst.name);
                assert_eq!(inst.nodes, nodes[s], "nodes of {}", inst.name);
                assert!(inst.blocks <= inst.capacity_blocks);
            }
        }
    }
}

struct ChildIter<'a> {
    nodes: &'a [Node],
    next: u32,
}

impl Iterator for ChildIter<'_> {
    type Item = u32;
    fn next(&mut self) -> Option<u32> {
        if self.next == NONE {
            return None;
        }
        let id = self.next;
        self.next = self.nodes[id as usize].next_sibling;
        Some(id)
    }
}
