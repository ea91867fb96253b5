//! Where a spawn of `n` children goes (docs/cluster.md, placement).
//!
//! Order of preference, per child: a node with a ready (pre-restored,
//! paused) child of the tag — a pool hit, milliseconds; then a node that
//! holds the snapshot — a restore on demand; then, only when no node
//! holds it, a node that pulls tags it lacks from the hub (a lazy pull:
//! kilobytes, then chunks as the restore reads them); among equals, the
//! least loaded. Ready children are spread: each next child goes to the
//! node with the most ready children left, so `n = 9` over three pools of
//! three takes three from each rather than draining one pool (which would
//! leave that node refilling while the others idle).

/// What placement knows of one node for one tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// Index of the node in the caller's list.
    pub node: usize,
    /// Ready children of the tag in its pool now.
    pub ready: usize,
    /// Whether it holds the snapshot (local or lazy).
    pub has_snapshot: bool,
    /// Its sandboxes now (the load measure).
    pub load: usize,
    /// Whether it pulls a tag it lacks from the hub (its `/version`'s `hub`).
    pub from_hub: bool,
}

/// `n` children over `candidates`: `(node, how many)` per chosen node, in
/// the order chosen; `None` when no candidate can restore the tag at all.
pub fn place(n: usize, candidates: &[Candidate]) -> Option<Vec<(usize, usize)>> {
    let held = candidates.iter().any(|c| c.has_snapshot || c.ready > 0);
    let mut c: Vec<Candidate> = candidates
        .iter()
        .filter(|c| c.has_snapshot || c.ready > 0 || (!held && c.from_hub))
        .cloned()
        .collect();
    if c.is_empty() {
        return None;
    }
    let mut out: Vec<(usize, usize)> = Vec::new();
    let mut add = |node: usize| match out.iter_mut().find(|(n, _)| *n == node) {
        Some((_, k)) => *k += 1,
        None => out.push((node, 1)),
    };
    for _ in 0..n {
        // A pool hit if any is left: the most ready first, then the least
        // loaded (load counts what this spawn already put there).
        let pick = match c.iter_mut().filter(|c| c.ready > 0).max_by(|a, b| {
            a.ready
                .cmp(&b.ready)
                .then(b.load.cmp(&a.load))
                .then(b.node.cmp(&a.node))
        }) {
            Some(best) => {
                best.ready -= 1;
                best
            }
            None => c
                .iter_mut()
                .min_by(|a, b| a.load.cmp(&b.load).then(a.node.cmp(&b.node)))
                .expect("non-empty"),
        };
        pick.load += 1;
        add(pick.node);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(node: usize, ready: usize, has: bool, load: usize) -> Candidate {
        Candidate {
            node,
            ready,
            has_snapshot: has,
            load,
            from_hub: false,
        }
    }

    fn hub_node(node: usize, load: usize) -> Candidate {
        Candidate {
            from_hub: true,
            ..cand(node, 0, false, load)
        }
    }

    fn sorted(mut v: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
        v.sort();
        v
    }

    #[test]
    fn nine_over_three_pools_of_three_takes_three_from_each() {
        let c = [
            cand(0, 3, true, 0),
            cand(1, 3, true, 5),
            cand(2, 3, true, 1),
        ];
        assert_eq!(sorted(place(9, &c).unwrap()), vec![(0, 3), (1, 3), (2, 3)]);
    }

    #[test]
    fn a_ready_child_beats_a_less_loaded_node() {
        let c = [cand(0, 0, true, 0), cand(1, 1, true, 50)];
        assert_eq!(place(1, &c).unwrap(), vec![(1, 1)]);
    }

    #[test]
    fn past_the_pools_the_least_loaded_holder_restores() {
        let c = [
            cand(0, 1, true, 4),
            cand(1, 0, true, 0),
            cand(2, 0, false, 0),
        ];
        // One hit on node 0 (load 5 then), then node 1 (load 0) takes the
        // on-demand restores until it is as loaded, then they alternate;
        // node 2 lacks the snapshot.
        let got = sorted(place(8, &c).unwrap());
        assert_eq!(got, vec![(0, 2), (1, 6)]);
    }

    #[test]
    fn no_node_with_the_snapshot_places_nothing() {
        assert_eq!(place(1, &[cand(0, 0, false, 0)]), None);
        assert_eq!(place(1, &[]), None);
    }

    #[test]
    fn a_hub_node_restores_only_when_no_node_holds_the_tag() {
        // A holder restores locally rather than a hub node pulling.
        let c = [hub_node(0, 0), cand(1, 0, true, 9)];
        assert_eq!(place(2, &c).unwrap(), vec![(1, 2)]);
        // No holder: the hub nodes pull, the least loaded first.
        let c = [hub_node(0, 3), hub_node(1, 0), cand(2, 0, false, 0)];
        assert_eq!(sorted(place(4, &c).unwrap()), vec![(0, 1), (1, 3)]);
    }

    #[test]
    fn every_child_is_placed_exactly_once() {
        for n in 1..40 {
            let c = [
                cand(0, 2, true, 3),
                cand(1, 0, true, 0),
                cand(2, 7, true, 9),
            ];
            let total: usize = place(n, &c).unwrap().iter().map(|(_, k)| k).sum();
            assert_eq!(total, n);
        }
    }
}
