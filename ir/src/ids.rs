//! Typed ids, one way: the [`entity!`](crate::entity) macro makes a u32 newtype that prints
//! short (`n12`, `p3`, `m2`), and [`IdVec`] is a side table indexed by one.
//!
//! The model is Cranelift's `entity_impl!` / `PrimaryMap`: an id is a dense index into the
//! table that made it, so a table keyed by `NodeId` cannot be indexed by a `GroupId` by
//! mistake. Every id in the workspace (`NodeId`, `ParamId`, `ScopeId` here; `GroupId`,
//! `StepId`, `BufId`, `EventId` in the planner) is defined with this one macro.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::hash::Hash;
use std::marker::PhantomData;
use std::ops::{Index, IndexMut};

/// What every id made by [`entity!`](crate::entity) implements: a dense index with a printed
/// prefix. Generic code (such as [`IdVec`]) works through this trait.
pub trait Entity: Copy + Eq + Ord + Hash + fmt::Debug + fmt::Display {
    /// What the id prints before its number (`n` for `n12`).
    const PREFIX: &'static str;

    /// The id of table slot `index`; panics when `index` does not fit a u32.
    fn new(index: usize) -> Self;

    /// The id as an index into its side table.
    fn index(self) -> usize;
}

/// Defines a typed id: a `Copy` u32 newtype that serialises as a bare number (the same bytes
/// as `#[serde(transparent)]`), prints as `prefix` + number, and implements
/// [`Entity`](crate::Entity).
///
/// ```
/// shardplan_ir::entity! {
///     /// A widget (printed `w3`).
///     pub struct WidgetId("w");
/// }
/// let w = WidgetId::new(3);
/// assert_eq!((w.to_string(), w.index()), ("w3".to_string(), 3));
/// ```
#[macro_export]
macro_rules! entity {
    ($(#[$meta:meta])* $vis:vis struct $name:ident($prefix:literal);) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        $vis struct $name(pub u32);

        impl $name {
            /// The id of table slot `index`; panics when `index` does not fit a u32.
            #[inline]
            pub const fn new(index: usize) -> Self {
                assert!(index <= u32::MAX as usize, concat!(stringify!($name), " space exhausted"));
                $name(index as u32)
            }

            /// The id as an index into its side table.
            #[inline]
            pub const fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl $crate::Entity for $name {
            const PREFIX: &'static str = $prefix;

            #[inline]
            fn new(index: usize) -> Self {
                $name::new(index)
            }

            #[inline]
            fn index(self) -> usize {
                $name::index(self)
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }

        // Written out rather than derived so that crates using the macro need no serde
        // attributes naming this crate; the bytes are those of `#[serde(transparent)]`.
        impl $crate::__private::serde::Serialize for $name {
            fn serialize<S: $crate::__private::serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_u32(self.0)
            }
        }

        impl<'de> $crate::__private::serde::Deserialize<'de> for $name {
            fn deserialize<D: $crate::__private::serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                <u32 as $crate::__private::serde::Deserialize>::deserialize(d).map($name)
            }
        }
    };
}

#[doc(hidden)]
pub mod __private {
    pub use serde;
}

entity! {
    /// A node of the graph; every node produces exactly one value, so this is also a value id.
    pub struct NodeId("n");
}
entity! {
    /// A trainable parameter (an entry of the graph's parameter table).
    pub struct ParamId("p");
}
entity! {
    /// A module scope (`layers.3.attention`), printed `m2` (`s` is a planner step).
    pub struct ScopeId("m");
}

/// A side table keyed by an id: `push` hands out the next id, and only that id type indexes
/// it. Serialises as the plain list of values, so swapping a `Vec` for an `IdVec` leaves a
/// serialised format unchanged.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent, bound(serialize = "V: Serialize", deserialize = "V: Deserialize<'de>"))]
pub struct IdVec<K, V> {
    items: Vec<V>,
    #[serde(skip)]
    key: PhantomData<fn(K) -> K>,
}

impl<K: Entity, V> IdVec<K, V> {
    pub fn new() -> Self {
        Vec::new().into()
    }

    pub fn with_capacity(capacity: usize) -> Self {
        Vec::with_capacity(capacity).into()
    }

    /// `len` copies of `value`, one per id `0..len` (a filled secondary table).
    pub fn from_elem(value: V, len: usize) -> Self
    where
        V: Clone,
    {
        vec![value; len].into()
    }

    /// Appends `value` and returns its id.
    pub fn push(&mut self, value: V) -> K {
        let key = self.next_key();
        self.items.push(value);
        key
    }

    /// The id the next `push` returns.
    pub fn next_key(&self) -> K {
        K::new(self.items.len())
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// True when `key` names a slot of this table.
    pub fn contains_key(&self, key: K) -> bool {
        key.index() < self.items.len()
    }

    pub fn get(&self, key: K) -> Option<&V> {
        self.items.get(key.index())
    }

    pub fn get_mut(&mut self, key: K) -> Option<&mut V> {
        self.items.get_mut(key.index())
    }

    /// `(id, value)` pairs in id order.
    pub fn iter(&self) -> IdVecIter<'_, K, V> {
        IdVecIter {
            inner: self.items.iter().enumerate(),
            key: PhantomData,
        }
    }

    /// `(id, value)` pairs in id order, values mutable.
    pub fn iter_mut(&mut self) -> impl DoubleEndedIterator<Item = (K, &mut V)> + ExactSizeIterator + '_ {
        self.items.iter_mut().enumerate().map(|(i, v)| (K::new(i), v))
    }

    /// Every id of the table, in order; it does not borrow the table, so a loop over the
    /// keys may write to it.
    pub fn keys(&self) -> std::iter::Map<std::ops::Range<usize>, fn(usize) -> K> {
        (0..self.items.len()).map(K::new as fn(usize) -> K)
    }

    pub fn values(&self) -> std::slice::Iter<'_, V> {
        self.items.iter()
    }

    pub fn values_mut(&mut self) -> std::slice::IterMut<'_, V> {
        self.items.iter_mut()
    }

    /// The values in id order, for code that wants a plain slice.
    pub fn as_slice(&self) -> &[V] {
        &self.items
    }

    pub fn into_vec(self) -> Vec<V> {
        self.items
    }
}

impl<K: Entity, V> Default for IdVec<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Entity, V: fmt::Debug> fmt::Debug for IdVec<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<K, V> From<Vec<V>> for IdVec<K, V> {
    fn from(items: Vec<V>) -> Self {
        IdVec {
            items,
            key: PhantomData,
        }
    }
}

impl<K, V> FromIterator<V> for IdVec<K, V> {
    fn from_iter<I: IntoIterator<Item = V>>(iter: I) -> Self {
        Vec::from_iter(iter).into()
    }
}

impl<K, V> Extend<V> for IdVec<K, V> {
    fn extend<I: IntoIterator<Item = V>>(&mut self, iter: I) {
        self.items.extend(iter);
    }
}

impl<K: Entity, V> Index<K> for IdVec<K, V> {
    type Output = V;

    #[inline]
    fn index(&self, key: K) -> &V {
        &self.items[key.index()]
    }
}

impl<K: Entity, V> IndexMut<K> for IdVec<K, V> {
    #[inline]
    fn index_mut(&mut self, key: K) -> &mut V {
        &mut self.items[key.index()]
    }
}

/// Iterator over an [`IdVec`]'s `(id, &value)` pairs.
pub struct IdVecIter<'a, K, V> {
    inner: std::iter::Enumerate<std::slice::Iter<'a, V>>,
    key: PhantomData<fn(K) -> K>,
}

impl<'a, K: Entity, V> Iterator for IdVecIter<'a, K, V> {
    type Item = (K, &'a V);

    fn next(&mut self) -> Option<Self::Item> {
        self.inner.next().map(|(i, v)| (K::new(i), v))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.inner.size_hint()
    }
}

impl<K: Entity, V> DoubleEndedIterator for IdVecIter<'_, K, V> {
    fn next_back(&mut self) -> Option<Self::Item> {
        self.inner.next_back().map(|(i, v)| (K::new(i), v))
    }
}

impl<K: Entity, V> ExactSizeIterator for IdVecIter<'_, K, V> {}

impl<'a, K: Entity, V> IntoIterator for &'a IdVec<K, V> {
    type Item = (K, &'a V);
    type IntoIter = IdVecIter<'a, K, V>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    entity! {
        /// A test id.
        struct TestId("t");
    }

    #[test]
    fn ids_print_with_their_prefix_and_round_trip_their_index() {
        assert_eq!(NodeId::new(12).to_string(), "n12");
        assert_eq!(ParamId::new(3).to_string(), "p3");
        assert_eq!(ScopeId::new(2).to_string(), "m2");
        assert_eq!(TestId::new(7).index(), 7);
        assert_eq!(<TestId as Entity>::new(7), TestId(7));
        assert_eq!(<TestId as Entity>::PREFIX, "t");
    }

    #[test]
    #[should_panic(expected = "TestId space exhausted")]
    fn new_rejects_an_index_past_u32() {
        let _ = TestId::new(u32::MAX as usize + 1);
    }

    #[test]
    fn ids_serialise_as_bare_numbers() {
        let json = serde_json::to_string(&[TestId(4), TestId(9)]).unwrap();
        assert_eq!(json, "[4,9]");
        let back: Vec<TestId> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, [TestId(4), TestId(9)]);
    }

    #[test]
    fn push_hands_out_consecutive_ids_that_index_the_table() {
        let mut t: IdVec<TestId, &str> = IdVec::with_capacity(2);
        assert!(t.is_empty());
        assert_eq!(t.next_key(), TestId(0));
        let a = t.push("a");
        let b = t.push("b");
        assert_eq!((a, b), (TestId(0), TestId(1)));
        assert_eq!((t[a], t[b], t.len()), ("a", "b", 2));
        t[b] = "B";
        assert_eq!(t.get(b), Some(&"B"));
        assert_eq!(t.get(TestId(2)), None);
        assert!(t.contains_key(b) && !t.contains_key(TestId(2)));
        assert_eq!(t.keys().collect::<Vec<_>>(), [a, b]);
        assert_eq!(t.iter().collect::<Vec<_>>(), [(a, &"a"), (b, &"B")]);
        assert_eq!(t.iter().rev().map(|(k, _)| k).collect::<Vec<_>>(), [b, a]);
        for (k, v) in t.iter_mut() {
            if k == a {
                *v = "A";
            }
        }
        assert_eq!(t.values().copied().collect::<Vec<_>>(), ["A", "B"]);
        assert_eq!(format!("{t:?}"), r#"{TestId(0): "A", TestId(1): "B"}"#);
    }

    #[test]
    fn filled_and_collected_tables() {
        let mut t: IdVec<TestId, u64> = IdVec::from_elem(0, 3);
        t[TestId(2)] += 5;
        assert_eq!(t.as_slice(), [0, 0, 5]);
        let u: IdVec<TestId, u64> = (1..=3).collect();
        assert_eq!(u.into_vec(), [1, 2, 3]);
        let mut v = IdVec::<TestId, u64>::from(vec![1]);
        v.extend([2]);
        assert_eq!(v, IdVec::from(vec![1, 2]));
        assert_eq!(IdVec::<TestId, u8>::default().len(), 0);
    }

    #[test]
    fn an_id_vec_serialises_as_its_plain_list() {
        let t: IdVec<TestId, u32> = vec![5, 6].into();
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(json, serde_json::to_string(&vec![5u32, 6]).unwrap());
        let back: IdVec<TestId, u32> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, t);
    }
}
