//! Behaviour tests for the index, and a property test against a dictionary-of-prefixes model.

use std::collections::HashMap;

use proptest::prelude::*;
use smetric_prefix_index::{chain_ids, hash_text, IndexError, PrefixIndex, GLOBAL_TIER};

fn idx(instances: &[(&str, u64)]) -> PrefixIndex {
    let mut index = PrefixIndex::new();
    for &(name, cap) in instances {
        index.add_instance(name, cap).unwrap();
    }
    index
}

#[test]
fn match_reports_leading_blocks_per_instance_in_add_order() {
    let mut index = idx(&[("a", 100), ("b", 100), ("c", 100)]);
    let session = chain_ids(&[1, 2, 3, 4, 5]);
    index.insert("a", &session[..3]).unwrap();
    index.insert("b", &session).unwrap();
    let m = index.match_all(&session);
    assert_eq!(m.blocks, vec![3, 5, 0]);
    assert_eq!(m.global_blocks, 0);
    assert_eq!(index.instances(), vec!["a", "b", "c"]);
}

#[test]
fn a_shared_prefix_is_stored_once() {
    let mut index = idx(&[("a", 100), ("b", 100)]);
    let x = chain_ids(&[1, 2, 3, 10, 11]);
    let y = chain_ids(&[1, 2, 3, 20, 21]);
    index.insert("a", &x).unwrap();
    index.insert("b", &y).unwrap();
    assert_eq!(index.match_all(&x).blocks, vec![5, 3]);
    assert_eq!(index.match_all(&y).blocks, vec![3, 5]);
    let s = index.stats();
    assert_eq!(s.unique_blocks, 7);
    assert_eq!(s.instances[0].blocks, 5);
    index.check_invariants();
}

#[test]
fn insert_past_capacity_evicts_least_recent_leaves_first() {
    let mut index = idx(&[("a", 6)]);
    let old = chain_ids(&[1, 2, 3, 4]);
    let new = chain_ids(&[1, 2, 7, 8]);
    index.insert("a", &old).unwrap();
    index.insert("a", &new).unwrap(); // 6 blocks held: 1 2 3 4 and 7 8
    let newer = chain_ids(&[9, 9]);
    index.insert("a", &newer).unwrap(); // two blocks over: the old session's tail goes
    assert_eq!(index.match_all(&old).blocks, vec![2]);
    assert_eq!(index.match_all(&new).blocks, vec![4]);
    assert_eq!(index.match_all(&newer).blocks, vec![2]);
    assert_eq!(index.stats().instances[0].evicted_blocks, 2);
    index.check_invariants();
}

#[test]
fn a_touching_match_protects_a_path_from_eviction() {
    let mut index = idx(&[("a", 4)]);
    let x = chain_ids(&[1, 2]);
    let y = chain_ids(&[3, 4]);
    index.insert("a", &x).unwrap();
    index.insert("a", &y).unwrap();
    index.match_all_touch(&x); // x is now the most recent
    index.insert("a", &chain_ids(&[5, 6])).unwrap();
    assert_eq!(index.match_all(&x).blocks, vec![2]);
    assert_eq!(index.match_all(&y).blocks, vec![0]);
    index.check_invariants();
}

#[test]
fn a_prompt_larger_than_capacity_keeps_its_leading_blocks() {
    let mut index = idx(&[("a", 3)]);
    let long = chain_ids(&[1, 2, 3, 4, 5, 6]);
    assert_eq!(index.insert("a", &long).unwrap(), 6);
    assert_eq!(index.match_all(&long).blocks, vec![3]);
    index.check_invariants();
}

#[test]
fn remove_drops_the_block_and_everything_below_it_for_that_instance_only() {
    let mut index = idx(&[("a", 100), ("b", 100)]);
    let x = chain_ids(&[1, 2, 3, 4, 5]);
    index.insert("a", &x).unwrap();
    index.insert("b", &x).unwrap();
    assert_eq!(index.remove("a", &x[2..3]).unwrap(), 3);
    assert_eq!(index.match_all(&x).blocks, vec![2, 5]);
    // Unknown keys are skipped; keys already gone count nothing.
    assert_eq!(index.remove("a", &[42, x[3]]).unwrap(), 0);
    index.check_invariants();
}

#[test]
fn clear_and_remove_instance_forget_everything_held() {
    let mut index = idx(&[("a", 100), ("b", 100)]);
    let x = chain_ids(&[1, 2, 3]);
    index.insert("a", &x).unwrap();
    index.insert("b", &x[..1]).unwrap();
    assert_eq!(index.clear("a").unwrap(), 3);
    assert_eq!(index.match_all(&x).blocks, vec![0, 1]);
    assert_eq!(index.remove_instance("b").unwrap(), 1);
    assert_eq!(index.stats().unique_blocks, 0);
    assert_eq!(index.stats().nodes, 0);
    assert_eq!(index.instances(), vec!["a"]);
    index.check_invariants();
}

#[test]
fn the_global_tier_is_matched_apart_with_its_own_capacity() {
    let mut index = idx(&[("a", 100), (GLOBAL_TIER, 2)]);
    let x = chain_ids(&[1, 2, 3]);
    index.insert(GLOBAL_TIER, &x).unwrap();
    let m = index.match_all(&x);
    assert_eq!(m.blocks, vec![0]);
    assert_eq!(m.global_blocks, 2);
    assert_eq!(index.instances(), vec!["a"]);
}

#[test]
fn shrinking_capacity_evicts_at_once() {
    let mut index = idx(&[("a", 100)]);
    let x = chain_ids(&[1, 2, 3, 4]);
    index.insert("a", &x).unwrap();
    assert_eq!(index.set_capacity("a", 1).unwrap(), 3);
    assert_eq!(index.match_all(&x).blocks, vec![1]);
}

#[test]
fn bad_calls_fail_and_change_nothing() {
    let mut index = idx(&[("a", 100)]);
    let x = chain_ids(&[1, 2, 3]);
    index.insert("a", &x).unwrap();
    let before = index.stats();
    assert_eq!(
        index.insert("nope", &x),
        Err(IndexError::UnknownInstance("nope".into()))
    );
    assert!(matches!(
        index.add_instance("a", 1),
        Err(IndexError::DuplicateInstance(_))
    ));
    assert!(matches!(
        index.add_instance("", 1),
        Err(IndexError::InvalidName(_))
    ));
    // Unchained keys: the new part reuses a key that names another prefix.
    let bad = [x[0], 77, x[2]];
    assert_eq!(
        index.insert("a", &bad),
        Err(IndexError::KeyConflict { position: 2 })
    );
    // Same contents (bytes_used may differ: a rolled-back insert can leave spare capacity).
    let after = index.stats();
    assert_eq!(
        (after.instances, after.nodes, after.unique_blocks),
        (before.instances, before.nodes, before.unique_blocks)
    );
    assert_eq!(index.match_all(&x).blocks, vec![3]);
    index.check_invariants();
}

#[test]
fn text_keys_match_a_follow_up_turn() {
    let mut index = idx(&[("a", 1000), ("b", 1000)]);
    let turn1 = "You are a helpful agent. ".repeat(20) + "User: book a flight.";
    let turn2 = turn1.clone() + " Assistant: done. User: now a hotel, please, near the airport.";
    index.insert("b", &hash_text(turn1.as_bytes(), 64)).unwrap();
    let m = index.match_all(&hash_text(turn2.as_bytes(), 64));
    assert_eq!(m.blocks[0], 0);
    assert_eq!(m.blocks[1] as usize, turn1.len() / 64);
}

// ---- the property test --------------------------------------------------------------------

/// The model: per instance, the set of whole prefixes it holds, each with an LRU stamp
/// (tick of last use, depth); eviction takes the smallest (tick, -depth).
#[derive(Default)]
struct Model {
    caps: Vec<u64>,
    held: Vec<HashMap<Vec<u8>, (u64, usize)>>,
    tick: u64,
}

impl Model {
    fn evict(&mut self, s: usize) {
        while self.held[s].len() as u64 > self.caps[s] {
            let victim = self.held[s]
                .iter()
                .min_by_key(|(_, &(t, d))| (t, std::cmp::Reverse(d)))
                .map(|(p, _)| p.clone())
                .unwrap();
            self.held[s].remove(&victim);
        }
    }

    fn insert(&mut self, s: usize, prompt: &[u8]) -> u64 {
        self.tick += 1;
        let mut added = 0;
        for d in 1..=prompt.len() {
            if self.held[s]
                .insert(prompt[..d].to_vec(), (self.tick, d))
                .is_none()
            {
                added += 1;
            }
        }
        self.evict(s);
        added
    }

    fn matched(&self, s: usize, prompt: &[u8]) -> usize {
        (1..=prompt.len())
            .take_while(|&d| self.held[s].contains_key(&prompt[..d]))
            .count()
    }

    fn touch(&mut self, prompt: &[u8]) {
        self.tick += 1;
        for s in 0..self.held.len() {
            for d in 1..=self.matched(s, prompt) {
                self.held[s].get_mut(&prompt[..d]).unwrap().0 = self.tick;
            }
        }
    }

    fn remove(&mut self, s: usize, prefix: &[u8]) -> u64 {
        let before = self.held[s].len();
        if self.held[s].contains_key(prefix) {
            self.held[s].retain(|p, _| !p.starts_with(prefix));
        }
        (before - self.held[s].len()) as u64
    }
}

impl Model {
    fn touch_one(&mut self, s: usize, prompt: &[u8]) {
        self.tick += 1;
        for d in 1..=self.matched(s, prompt) {
            self.held[s].get_mut(&prompt[..d]).unwrap().0 = self.tick;
        }
    }
}
#[derive(Debug, Clone)]
enum Op {
    Insert(usize, Vec<u8>),
    Match(Vec<u8>, bool),
    MatchOne(usize, Vec<u8>),
    Remove(usize, Vec<u8>, Vec<usize>),
    Clear(usize),
    SetCapacity(usize, u64),
    Readd(usize),
}
fn prompt() -> impl Strategy<Value = Vec<u8>> {
    // A small alphabet makes prompts share prefixes often.
    prop::collection::vec(0u8..3, 0..12)
}
fn op(n: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..n, prompt()).prop_map(|(s, p)| Op::Insert(s, p)),
        2 => (prompt(), any::<bool>()).prop_map(|(p, t)| Op::Match(p, t)),
        2 => (0..n, prompt()).prop_map(|(s, p)| Op::MatchOne(s, p)),
        2 => (0..n, prompt(), prop::collection::vec(0usize..12, 0..4)).prop_map(|(s, p, k)| Op::Remove(s, p, k)),
        1 => (0..n).prop_map(Op::Clear),
        1 => (0..n, 0u64..20).prop_map(|(s, c)| Op::SetCapacity(s, c)),
        1 => (0..n).prop_map(Op::Readd),
    ]
}
fn keys_of(prompt: &[u8]) -> Vec<u64> {
    let ids: Vec<u64> = prompt.iter().map(|&b| u64::from(b)).collect();
    chain_ids(&ids)
}
proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]
    #[test]
    fn index_agrees_with_the_prefix_set_model(
        caps in prop::collection::vec(0u64..16, 1..4),
        ops in prop::collection::vec(op(4), 1..80),
    ) {
        let n = caps.len();
        let names: Vec<String> = (0..n).map(|i| format!("w{i}")).collect();
        let mut index = PrefixIndex::new();
        let mut model = Model { caps: caps.clone(), held: vec![HashMap::new(); n], tick: 0 };
        for (name, &cap) in names.iter().zip(&caps) {
            index.add_instance(name, cap).unwrap();
        }
        for op in ops {
            match op {
                Op::Insert(s, p) => {
                    let s = s % n;
                    let got = index.insert(&names[s], &keys_of(&p)).unwrap();
                    prop_assert_eq!(got, model.insert(s, &p));
                }
                Op::Match(p, touch) => {
                    let keys = keys_of(&p);
                    let got = if touch { index.match_all_touch(&keys) } else { index.match_all(&keys) };
                    let order = index.instances();
                    let want: Vec<u32> = order.iter().map(|nm| { let s = names.iter().position(|x| x == nm).unwrap(); model.matched(s, &p) as u32 }).collect();
                    prop_assert_eq!(got.blocks, want);
                    if touch { model.touch(&p); }
                }
                Op::MatchOne(s, p) => {
                    let s = s % n;
                    let got = index.match_instance_touch(&names[s], &keys_of(&p)).unwrap();
                    prop_assert_eq!(got as usize, model.matched(s, &p));
                    model.touch_one(s, &p);
                }
                Op::Remove(s, p, ks) => {
                    let s = s % n;
                    let keys = keys_of(&p);
                    let sel: Vec<u64> = ks.iter().filter(|&&k| k < keys.len()).map(|&k| keys[k]).collect();
                    let got = index.remove(&names[s], &sel).unwrap();
                    let mut want = 0;
                    for &k in ks.iter().filter(|&&k| k < keys.len()) {
                        want += model.remove(s, &p[..=k]);
                    }
                    prop_assert_eq!(got, want);
                }
                Op::Clear(s) => {
                    let s = s % n;
                    let got = index.clear(&names[s]).unwrap();
                    prop_assert_eq!(got, model.held[s].len() as u64);
                    model.held[s].clear();
                }
                Op::SetCapacity(s, c) => {
                    let s = s % n;
                    index.set_capacity(&names[s], c).unwrap();
                    model.caps[s] = c;
                    model.evict(s);
                }
                Op::Readd(s) => {
                    let s = s % n;
                    index.remove_instance(&names[s]).unwrap();
                    index.add_instance(&names[s], model.caps[s]).unwrap();
                    model.held[s].clear();
                }
            }
            index.check_invariants();
            let stats = index.stats();
            let order = index.instances();
            for (name, held) in names.iter().zip(&model.held) {
                let pos = order.iter().position(|x| x == name).unwrap();
                prop_assert_eq!(stats.instances[pos].blocks, held.len() as u64);
            }
        }
    }
}
