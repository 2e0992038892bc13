//! What a pickle holds once read: plain data, with the classes it names kept as names.

/// A value read from (or to be written as) a pickle. Objects are kept as what would build
/// them: the class, the arguments it is called with, and the state set on the result;
/// nothing is ever called.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    /// Key-value pairs in insertion order.
    Dict(Vec<(Value, Value)>),
    /// A module attribute named by the pickle (`torch.float32`, a class).
    Global(Global),
    /// `class(*args)` (REDUCE) or `class.__new__(class, *args)` (NEWOBJ, as dataclasses
    /// pickle), with `state` applied (BUILD) when set.
    Object {
        class: Global,
        by: Construct,
        args: Vec<Value>,
        state: Option<Box<Value>>,
    },
    /// A reference to data kept outside the pickle (torch.save's storages).
    PersistentId(Box<Value>),
}

/// How an object is made from its class and arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Construct {
    /// Calling the class (REDUCE): `torch.Size([..])`, `_rebuild_tensor_v2(..)`.
    Call,
    /// `__new__` without `__init__` (NEWOBJ), the state set after: dataclasses.
    New,
}

/// A module attribute: `module.name`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Global {
    pub module: String,
    pub name: String,
}

impl Global {
    pub fn new(module: &str, name: &str) -> Global {
        Global {
            module: module.to_string(),
            name: name.to_string(),
        }
    }
}

impl std::fmt::Display for Global {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.module, self.name)
    }
}

impl Value {
    /// A string value.
    pub fn str(s: impl Into<String>) -> Value {
        Value::Str(s.into())
    }

    /// What kind of value this is, for messages.
    pub fn kind(&self) -> String {
        match self {
            Value::None => "None".into(),
            Value::Bool(_) => "a bool".into(),
            Value::Int(_) => "an int".into(),
            Value::Float(_) => "a float".into(),
            Value::Str(_) => "a str".into(),
            Value::Bytes(_) => "bytes".into(),
            Value::Tuple(_) => "a tuple".into(),
            Value::List(_) => "a list".into(),
            Value::Dict(_) => "a dict".into(),
            Value::Global(g) => format!("`{g}`"),
            Value::Object { class, .. } => format!("a `{class}`"),
            Value::PersistentId(_) => "a persistent id".into(),
        }
    }

    /// The value under string key `key` of a dict.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => items
                .iter()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }
}
