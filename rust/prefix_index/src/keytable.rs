//! The index's map from a block key to where the block lies (its node and its offset in it):
//! open addressing with linear probing over 16-byte slots, a power of two of them, grown when
//! three quarters full.
//!
//! Why not std's `HashMap`: a prompt's keys are hashes, so each lands in a cold cache line of a
//! table that, for a large global tier, spans a hundred megabytes; a long prompt inserts (and
//! an eviction removes) thousands of them, each a cache and TLB miss, mostly waited out one after
//! another. Here the caller can `prefetch` the slot of a key a few places ahead, so that the
//! misses of a run of keys overlap.

/// A slot: `[key, node << 32 | offset]`. Key 0 marks an empty slot; the entry of key 0 itself
/// is kept apart (`zero`).
type Slot = [u64; 2];

const EMPTY: u64 = 0;
const MIN_SLOTS: usize = 16;

/// How far ahead of the key in hand a loop over keys prefetches (`KeyTable::prefetch_ahead`).
const PREFETCH_AHEAD: usize = 16;
/// Tables from this many slots (256 KiB) are prefetched.
const PREFETCH_FROM_SLOTS: usize = 1 << 14;

#[derive(Default)]
pub struct KeyTable {
    slots: Box<[Slot]>,
    /// `64 - log2(slots.len())`: a key's home slot is the top bits of its mixed hash.
    shift: u32,
    /// Entries in `slots` (key 0's not counted).
    used: usize,
    zero: Option<(u32, u32)>,
}

impl std::fmt::Debug for KeyTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyTable")
            .field("len", &self.len())
            .field("slots", &self.slots.len())
            .finish()
    }
}

fn pack(v: (u32, u32)) -> u64 {
    (u64::from(v.0) << 32) | u64::from(v.1)
}

fn unpack(v: u64) -> (u32, u32) {
    ((v >> 32) as u32, v as u32)
}

/// Block keys are hashes already, but caller-supplied ids (trace `hash_ids`) can be small
/// sequential integers: a folded multiply spreads both over the table.
fn mix(k: u64) -> u64 {
    let product = u128::from(k) * 0x9E37_79B9_7F4A_7C15_u128;
    (product as u64) ^ ((product >> 64) as u64)
}

impl KeyTable {
    pub fn len(&self) -> usize {
        self.used + usize::from(self.zero.is_some())
    }

    /// Bytes the table takes.
    pub fn bytes(&self) -> usize {
        self.slots.len() * size_of::<Slot>()
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    fn home(&self, k: u64) -> usize {
        (mix(k) >> self.shift) as usize
    }

    /// In a loop over `keys`, at `keys[i]`: starts loading the slot of the key `PREFETCH_AHEAD`
    /// places further on, for its lookup, insert or removal then.
    #[inline]
    pub fn prefetch_ahead(&self, keys: &[u64], i: usize) {
        if let Some(&ahead) = keys.get(i + PREFETCH_AHEAD) {
            self.prefetch(ahead);
        }
    }

    /// Starts loading the cache line of `k`'s home slot.
    #[inline]
    fn prefetch(&self, k: u64) {
        if self.slots.len() < PREFETCH_FROM_SLOTS {
            return; // within the caches: the prefetch's own work would be all it changes
        }
        let _slot: *const Slot = &self.slots[self.home(k)];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch is only a hint: it never faults, whatever the address.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(_slot.cast::<i8>());
        }
    }

    /// The slot holding `k` (not 0), if any.
    fn find(&self, k: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(k);
        loop {
            match self.slots[i][0] {
                key if key == k => return Some(i),
                EMPTY => return None,
                _ => i = (i + 1) & mask,
            }
        }
    }

    pub fn get(&self, k: u64) -> Option<(u32, u32)> {
        if k == EMPTY {
            return self.zero;
        }
        self.find(k).map(|i| unpack(self.slots[i][1]))
    }

    /// Rewrites the entry of `k`, which must be in the table; false (and no change) if not.
    pub fn set(&mut self, k: u64, v: (u32, u32)) -> bool {
        if k == EMPTY {
            return match &mut self.zero {
                Some(z) => {
                    *z = v;
                    true
                }
                None => false,
            };
        }
        match self.find(k) {
            Some(i) => {
                self.slots[i][1] = pack(v);
                true
            }
            None => false,
        }
    }

    /// Adds `k` unless it is already there; false (and no change) if it is.
    pub fn insert_new(&mut self, k: u64, v: (u32, u32)) -> bool {
        if k == EMPTY {
            if self.zero.is_some() {
                return false;
            }
            self.zero = Some(v);
            return true;
        }
        self.reserve(1);
        let mask = self.mask();
        let mut i = self.home(k);
        loop {
            match self.slots[i][0] {
                key if key == k => return false,
                EMPTY => {
                    self.slots[i] = [k, pack(v)];
                    self.used += 1;
                    return true;
                }
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// Removes `k`; returns its entry, if it was there.
    pub fn remove(&mut self, k: u64) -> Option<(u32, u32)> {
        if k == EMPTY {
            return self.zero.take();
        }
        let mut hole = self.find(k)?;
        let v = unpack(self.slots[hole][1]);
        // Backward shift: each later entry of the run moves into the hole if its home lies at
        // or before the hole, so every entry stays reachable from its home without tombstones.
        let mask = self.mask();
        let mut j = (hole + 1) & mask;
        while self.slots[j][0] != EMPTY {
            let from_home = j.wrapping_sub(self.home(self.slots[j][0])) & mask;
            if from_home >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.slots[hole] = [EMPTY, 0];
        self.used -= 1;
        Some(v)
    }

    /// Makes room for `additional` more entries without growing in between.
    pub fn reserve(&mut self, additional: usize) {
        let needed = self.used + additional;
        if needed * 4 <= self.slots.len() * 3 {
            return;
        }
        let slots = (needed * 4 / 3 + 1).next_power_of_two().max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, empty_slots(slots));
        self.shift = 64 - slots.trailing_zeros();
        let mask = self.mask();
        for (n, s) in old.iter().enumerate() {
            if let Some(ahead) = old.get(n + PREFETCH_AHEAD).filter(|a| a[0] != EMPTY) {
                self.prefetch(ahead[0]);
            }
            if s[0] == EMPTY {
                continue;
            }
            let mut i = self.home(s[0]);
            while self.slots[i][0] != EMPTY {
                i = (i + 1) & mask;
            }
            self.slots[i] = *s;
        }
    }
}

/// `len` empty slots, written as zeros rather than allocated zeroed: a large zeroed allocation
/// is fresh pages, which the reinsertion would first read (mapping the shared zero page) and then
/// write (a second fault, to copy it), where a write takes one fault per page.
fn empty_slots(len: usize) -> Box<[Slot]> {
    let mut slots = Vec::with_capacity(len);
    slots.resize(len, [EMPTY, 0]);
    slots.into_boxed_slice()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn grows_and_keeps_every_entry() {
        let mut t = KeyTable::default();
        for k in 0..10_000u64 {
            assert!(t.insert_new(k * 7, (k as u32, 1)));
        }
        assert!(!t.insert_new(7, (9, 9)), "present: refused");
        assert_eq!(t.len(), 10_000);
        assert!(t.bytes() >= 10_000 * 16 * 4 / 3);
        for k in 0..10_000u64 {
            assert_eq!(t.get(k * 7), Some((k as u32, 1)));
        }
        assert_eq!(t.get(3), None);
    }

    #[test]
    fn key_zero_is_an_ordinary_key() {
        let mut t = KeyTable::default();
        assert_eq!(t.get(0), None);
        assert!(!t.set(0, (1, 1)));
        assert_eq!(t.get(0), None);
        assert!(t.insert_new(0, (1, 2)));
        assert!(!t.insert_new(0, (3, 4)));
        assert!(t.set(0, (5, 6)));
        assert_eq!((t.get(0), t.len()), (Some((5, 6)), 1));
        assert_eq!(t.remove(0), Some((5, 6)));
        assert_eq!((t.get(0), t.len(), t.remove(0)), (None, 0, None));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u32),
        Remove(u64),
        Set(u64, u32),
        Reserve(usize),
    }

    /// Keys from a small range, so that runs collide and wrap: few home slots for many keys.
    fn op() -> impl Strategy<Value = Op> {
        let key = prop_oneof![0..64u64, any::<u64>()];
        prop_oneof![
            4 => (key.clone(), any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            3 => key.clone().prop_map(Op::Remove),
            1 => (key, any::<u32>()).prop_map(|(k, v)| Op::Set(k, v)),
            1 => (0..100usize).prop_map(Op::Reserve),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]
        /// Any sequence of operations answers as std's `HashMap` does.
        #[test]
        fn behaves_as_a_hash_map(ops in proptest::collection::vec(op(), 1..400)) {
            let mut t = KeyTable::default();
            let mut m: HashMap<u64, (u32, u32)> = HashMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, v) => {
                        let fresh = !m.contains_key(&k);
                        if fresh {
                            m.insert(k, (v, !v));
                        }
                        prop_assert_eq!(t.insert_new(k, (v, !v)), fresh);
                    }
                    Op::Remove(k) => prop_assert_eq!(t.remove(k), m.remove(&k)),
                    Op::Set(k, v) => {
                        let there = m.contains_key(&k);
                        if there {
                            m.insert(k, (v, v));
                        }
                        prop_assert_eq!(t.set(k, (v, v)), there);
                    }
                    Op::Reserve(n) => t.reserve(n),
                }
                prop_assert_eq!(t.len(), m.len());
            }
            for (k, v) in &m {
                prop_assert_eq!(t.get(*k), Some(*v));
            }
            for k in 0..64u64 {
                prop_assert_eq!(t.get(k), m.get(&k).copied());
            }
        }
    }

    /// A table kept small (16 slots) with its runs wrapping past the end: removal shifts entries
    /// back across the wrap, and every one stays reachable.
    #[test]
    fn removal_shifts_back_across_the_end() {
        let mut t = KeyTable::default();
        t.reserve(1);
        assert_eq!(t.slots.len(), MIN_SLOTS);
        // Keys whose home is the last slot, so their run wraps to the start.
        let last: Vec<u64> = (1..100_000u64)
            .filter(|&k| t.home(k) == MIN_SLOTS - 1)
            .take(5)
            .collect();
        for (i, &k) in last.iter().enumerate() {
            assert!(t.insert_new(k, (i as u32, 0)));
        }
        assert_eq!(t.slots.len(), MIN_SLOTS, "no growth at 5 of 16");
        assert_eq!(t.remove(last[0]), Some((0, 0)));
        assert_eq!(t.remove(last[2]), Some((2, 0)));
        for (i, &k) in last.iter().enumerate() {
            let expect = (i != 0 && i != 2).then_some((i as u32, 0));
            assert_eq!(t.get(k), expect);
        }
    }
}
