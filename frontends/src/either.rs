//! Deserializers for fields that take one of two shapes (`hardware: h100-sxm` or a map of
//! numbers; `reshard_after_forward: true` or `2`). Unlike `#[serde(untagged)]`, these keep
//! the inner error (an unknown key inside the map is still reported as such).

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::fmt;
use std::marker::PhantomData;

/// A name, or a map deserialized as `T`.
#[derive(Debug, Clone, PartialEq)]
pub enum NameOr<T> {
    Name(String),
    Map(T),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for NameOr<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = NameOr<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a name or a mapping")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(NameOr::Name(v.to_string()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(NameOr::Map)
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// `true`, `false`, or a whole number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoolOrInt {
    Bool(bool),
    Int(u64),
}

impl<'de> Deserialize<'de> for BoolOrInt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = BoolOrInt;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("true, false or a positive integer")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(BoolOrInt::Bool(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(BoolOrInt::Int(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                u64::try_from(v)
                    .map(BoolOrInt::Int)
                    .map_err(|_| E::custom(format!("expected true, false or a positive integer, got {v}")))
            }
        }
        d.deserialize_any(V)
    }
}

/// `true`, `false`, or a map deserialized as `T`.
#[derive(Debug, Clone, PartialEq)]
pub enum BoolOr<T> {
    Bool(bool),
    Map(T),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for BoolOr<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = BoolOr<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("true, false or a mapping")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(BoolOr::Bool(v))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(BoolOr::Map)
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}
