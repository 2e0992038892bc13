//! Reading a pickle without running it: a small machine that understands the opcodes of
//! protocols 2 to 5 that torch and `pickle.dump` write, and builds data from them.
//!
//! Python's unpickler calls whatever a pickle names; this one calls nothing. A class or
//! function the pickle names (GLOBAL, STACK_GLOBAL) must be on the caller's allow-list,
//! and REDUCE / NEWOBJ / BUILD only record what would be called, with which arguments and
//! state ([`Value::Object`]). Objects live in an arena while the pickle is read, so the
//! memo shares them as Python's does (an APPEND to a memoised list shows wherever it is
//! referenced) without copying; the result is then unfolded into a tree under a budget
//! of nodes, which refuses a pickle that refers to itself or multiplies through its memo.

use super::value::{Construct, Global, Value};

/// Why a pickle was refused: what, and at which byte.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} (at byte {at})")]
pub struct PickleError {
    pub at: usize,
    pub what: String,
}

/// What a pickle of `n` bytes may unfold into: the memo may share a value among a few
/// references, but not multiply it.
struct Budget {
    nodes: usize,
    /// Bytes of strings and byte strings.
    bytes: usize,
}

impl Budget {
    fn of(n: usize) -> Budget {
        Budget {
            nodes: n.saturating_mul(64).saturating_add(4096),
            bytes: n.saturating_mul(4).saturating_add(1 << 20),
        }
    }

    /// Counts one node holding `bytes` bytes; false once the budget is spent.
    fn spend(&mut self, bytes: usize) -> bool {
        if self.nodes == 0 || self.bytes < bytes {
            return false;
        }
        self.nodes -= 1;
        self.bytes -= bytes;
        true
    }
}

/// Nesting deeper than this is refused (no checkpoint nests more than a few levels).
const MAX_DEPTH: usize = 200;

type Id = usize;

/// A value in the arena: containers hold the ids of what they contain.
#[derive(Debug)]
enum Node {
    Scalar(Value),
    Tuple(Vec<Id>),
    List(Vec<Id>),
    Dict(Vec<(Id, Id)>),
    Object {
        class: Global,
        by: Construct,
        args: Vec<Id>,
        state: Option<Id>,
    },
    PersistentId(Id),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Item {
    Node(Id),
    Mark,
}

/// Reads one pickle from `bytes`; `allowed` says which globals it may name. Bytes after
/// its STOP are refused.
pub fn read(bytes: &[u8], allowed: &dyn Fn(&Global) -> bool) -> Result<Value, PickleError> {
    let mut m = Machine {
        input: bytes,
        at: 0,
        nodes: Vec::new(),
        stack: Vec::new(),
        memo: std::collections::HashMap::new(),
        allowed,
    };
    let top = m.run()?;
    if m.at != bytes.len() {
        return Err(PickleError {
            at: m.at,
            what: format!("{} bytes after the pickle's end", bytes.len() - m.at),
        });
    }
    let mut budget = Budget::of(bytes.len());
    let mut path = Vec::new();
    m.unfold(top, &mut budget, &mut path)
}

struct Machine<'a> {
    input: &'a [u8],
    /// The next byte to read.
    at: usize,
    nodes: Vec<Node>,
    stack: Vec<Item>,
    memo: std::collections::HashMap<u32, Id>,
    allowed: &'a dyn Fn(&Global) -> bool,
}

impl Machine<'_> {
    fn fail<T>(&self, what: impl Into<String>) -> Result<T, PickleError> {
        Err(PickleError {
            at: self.at,
            what: what.into(),
        })
    }

    fn take(&mut self, n: usize) -> Result<&[u8], PickleError> {
        if self.input.len() - self.at < n {
            return self.fail(format!(
                "the pickle ends inside a value ({n} bytes announced, {} left)",
                self.input.len() - self.at
            ));
        }
        let out = &self.input[self.at..self.at + n];
        self.at += n;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }

    fn le(&mut self, n: usize) -> Result<u64, PickleError> {
        let b = self.take(n)?;
        Ok(b.iter().rev().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
    }

    /// A length read as `n` little-endian bytes, checked against what is left.
    fn len(&mut self, n: usize) -> Result<usize, PickleError> {
        let len = self.le(n)?;
        match usize::try_from(len) {
            Ok(l) if l <= self.input.len() - self.at => Ok(l),
            _ => self.fail(format!(
                "a length of {len} bytes, past the pickle's end ({} bytes left)",
                self.input.len() - self.at
            )),
        }
    }

    fn push(&mut self, node: Node) {
        self.nodes.push(node);
        self.stack.push(Item::Node(self.nodes.len() - 1));
    }

    fn pop(&mut self) -> Result<Id, PickleError> {
        match self.stack.pop() {
            Some(Item::Node(id)) => Ok(id),
            Some(Item::Mark) => self.fail("a mark where a value was expected"),
            None => self.fail("an opcode reads from an empty stack"),
        }
    }

    fn top(&self) -> Result<Id, PickleError> {
        match self.stack.last() {
            Some(Item::Node(id)) => Ok(*id),
            _ => self.fail("an opcode needs a value on the stack"),
        }
    }

    /// Everything above the topmost mark, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<Id>, PickleError> {
        let Some(mark) = self.stack.iter().rposition(|i| *i == Item::Mark) else {
            return self.fail("no mark on the stack");
        };
        let items: Vec<Id> = self.stack[mark + 1..]
            .iter()
            .map(|i| match i {
                Item::Node(id) => *id,
                Item::Mark => unreachable!("the topmost mark is below"),
            })
            .collect();
        self.stack.truncate(mark);
        Ok(items)
    }

    fn text(&mut self, n: usize) -> Result<String, PickleError> {
        let len = self.len(n)?;
        let bytes = self.take(len)?.to_vec();
        String::from_utf8(bytes).or_else(|_| self.fail("a string that is not UTF-8"))
    }

    fn bytes(&mut self, n: usize) -> Result<Vec<u8>, PickleError> {
        let len = self.len(n)?;
        Ok(self.take(len)?.to_vec())
    }

    /// A little-endian two's-complement integer of `n` bytes (LONG1, LONG4).
    fn long(&mut self, n: usize) -> Result<i64, PickleError> {
        let len = self.len(n)?;
        if len > 8 {
            return self.fail(format!("an integer of {len} bytes (at most 8 are read)"));
        }
        let b = self.take(len)?;
        if b.is_empty() {
            return Ok(0);
        }
        let mut v = b.iter().rev().fold(0u64, |acc, &x| (acc << 8) | u64::from(x));
        if b[len - 1] & 0x80 != 0 && len < 8 {
            v |= u64::MAX << (8 * len);
        }
        Ok(v as i64)
    }

    fn line(&mut self) -> Result<String, PickleError> {
        let rest = &self.input[self.at..];
        let Some(end) = rest.iter().position(|&b| b == b'\n') else {
            return self.fail("a GLOBAL without its newline");
        };
        let s = String::from_utf8(rest[..end].to_vec()).or_else(|_| self.fail("a GLOBAL name that is not UTF-8"))?;
        self.at += end + 1;
        Ok(s)
    }

    fn global(&mut self, module: String, name: String) -> Result<(), PickleError> {
        let g = Global { module, name };
        if !(self.allowed)(&g) {
            return self.fail(format!(
                "the pickle names `{g}`, which a checkpoint never holds; refused"
            ));
        }
        self.push(Node::Scalar(Value::Global(g)));
        Ok(())
    }

    fn str_of(&self, id: Id) -> Result<String, PickleError> {
        match &self.nodes[id] {
            Node::Scalar(Value::Str(s)) => Ok(s.clone()),
            _ => self.fail("STACK_GLOBAL of a value that is not a string"),
        }
    }

    fn class_of(&self, id: Id, op: &str) -> Result<Global, PickleError> {
        match &self.nodes[id] {
            Node::Scalar(Value::Global(g)) => Ok(g.clone()),
            _ => self.fail(format!("{op} of something that is not a named class")),
        }
    }

    fn tuple_items(&self, id: Id, op: &str) -> Result<Vec<Id>, PickleError> {
        match &self.nodes[id] {
            Node::Tuple(items) => Ok(items.clone()),
            _ => self.fail(format!("{op} with arguments that are not a tuple")),
        }
    }

    /// `class(*args)`: an OrderedDict starts as a dict (its items come by SETITEMS), any
    /// other class as an object.
    fn call(&mut self, class: Global, by: Construct, args: Vec<Id>) {
        if class.module == "collections" && class.name == "OrderedDict" && args.is_empty() {
            self.push(Node::Dict(Vec::new()));
        } else {
            self.push(Node::Object {
                class,
                by,
                args,
                state: None,
            });
        }
    }

    fn build(&mut self) -> Result<(), PickleError> {
        let state = self.pop()?;
        let target = self.top()?;
        match &mut self.nodes[target] {
            Node::Object { state: s @ None, .. } => *s = Some(state),
            Node::Object { .. } => return self.fail("BUILD of an object twice"),
            _ => return self.fail("BUILD of a value that is not an object"),
        }
        Ok(())
    }

    fn append(&mut self, values: Vec<Id>) -> Result<(), PickleError> {
        let list = self.top()?;
        match &mut self.nodes[list] {
            Node::List(items) => items.extend(values),
            _ => return self.fail("APPEND to a value that is not a list"),
        }
        Ok(())
    }

    fn set_items(&mut self, kv: Vec<Id>) -> Result<(), PickleError> {
        if !kv.len().is_multiple_of(2) {
            return self.fail("SETITEMS with a key and no value");
        }
        let dict = self.top()?;
        match &mut self.nodes[dict] {
            Node::Dict(items) => items.extend(kv.chunks(2).map(|p| (p[0], p[1]))),
            _ => return self.fail("SETITEM on a value that is not a dict"),
        }
        Ok(())
    }

    fn memo_put(&mut self, key: u32) -> Result<(), PickleError> {
        let id = self.top()?;
        self.memo.insert(key, id);
        Ok(())
    }

    fn memo_get(&mut self, key: u32) -> Result<(), PickleError> {
        match self.memo.get(&key) {
            Some(&id) => {
                self.stack.push(Item::Node(id));
                Ok(())
            }
            None => self.fail(format!("memo entry {key} read before it is written")),
        }
    }

    /// Runs the opcodes up to STOP; returns the id of the value it leaves.
    fn run(&mut self) -> Result<Id, PickleError> {
        loop {
            let op = self.u8()?;
            match op {
                b'.' => return self.pop(),
                0x80 | 0x95 | b'(' | b'0' | b'1' | b'2' => self.control(op)?,
                b'N' | 0x88 | 0x89 | b'J' | b'K' | b'M' | 0x8a | 0x8b | b'G' | b'X' | 0x8c | 0x8d | b'B' | b'C'
                | 0x8e | 0x96 => self.scalar(op)?,
                b')' | b't' | 0x85..=0x87 | b']' | b'l' | b'a' | b'e' | b'}' | b'd' | b's' | b'u' => {
                    self.container(op)?
                }
                b'c' | 0x93 | b'R' | 0x81 | 0x92 | b'b' | b'Q' => self.object(op)?,
                b'q' | b'r' | 0x94 | b'h' | b'j' => self.memo_op(op)?,
                other => {
                    self.at -= 1;
                    return self.fail(format!("opcode 0x{other:02x}, which checkpoints do not use; refused"));
                }
            }
        }
    }

    /// The protocol, framing, marks and stack opcodes.
    fn control(&mut self, op: u8) -> Result<(), PickleError> {
        match op {
            0x80 => {
                let v = self.u8()?;
                if v > 5 {
                    return self.fail(format!("pickle protocol {v} (at most 5 is read)"));
                }
            }
            0x95 => {
                self.le(8)?;
            }
            b'(' => self.stack.push(Item::Mark),
            b'0' => {
                self.pop()?;
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let top = self.top()?;
                self.stack.push(Item::Node(top));
            }
            _ => return self.fail(format!("opcode 0x{op:02x} outside its group")),
        }
        Ok(())
    }

    /// Opcodes that push a constant, a number, a string or bytes.
    fn scalar(&mut self, op: u8) -> Result<(), PickleError> {
        match op {
            b'N' => self.push(Node::Scalar(Value::None)),
            0x88 => self.push(Node::Scalar(Value::Bool(true))),
            0x89 => self.push(Node::Scalar(Value::Bool(false))),
            b'J' => {
                let v = self.le(4)? as u32 as i32;
                self.push(Node::Scalar(Value::Int(i64::from(v))));
            }
            b'K' => {
                let v = self.le(1)?;
                self.push(Node::Scalar(Value::Int(v as i64)));
            }
            b'M' => {
                let v = self.le(2)?;
                self.push(Node::Scalar(Value::Int(v as i64)));
            }
            0x8a => {
                let v = self.long(1)?;
                self.push(Node::Scalar(Value::Int(v)));
            }
            0x8b => {
                let v = self.long(4)?;
                self.push(Node::Scalar(Value::Int(v)));
            }
            b'G' => {
                let b = self.take(8)?;
                let v = f64::from_be_bytes(b.try_into().expect("8 bytes"));
                self.push(Node::Scalar(Value::Float(v)));
            }
            b'X' | 0x8c | 0x8d => {
                let n = match op {
                    b'X' => 4,
                    0x8c => 1,
                    _ => 8,
                };
                let s = self.text(n)?;
                self.push(Node::Scalar(Value::Str(s)));
            }
            b'B' | b'C' | 0x8e | 0x96 => {
                let n = match op {
                    b'B' => 4,
                    b'C' => 1,
                    _ => 8,
                };
                let b = self.bytes(n)?;
                self.push(Node::Scalar(Value::Bytes(b)));
            }
            _ => return self.fail(format!("opcode 0x{op:02x} outside its group")),
        }
        Ok(())
    }

    /// Opcodes that make or fill tuples, lists and dicts.
    fn container(&mut self, op: u8) -> Result<(), PickleError> {
        match op {
            b')' => self.push(Node::Tuple(Vec::new())),
            b't' => {
                let items = self.pop_mark()?;
                self.push(Node::Tuple(items));
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.pop()?);
                }
                items.reverse();
                self.push(Node::Tuple(items));
            }
            b']' => self.push(Node::List(Vec::new())),
            b'l' => {
                let items = self.pop_mark()?;
                self.push(Node::List(items));
            }
            b'a' => {
                let v = self.pop()?;
                self.append(vec![v])?;
            }
            b'e' => {
                let items = self.pop_mark()?;
                self.append(items)?;
            }
            b'}' => self.push(Node::Dict(Vec::new())),
            b'd' => {
                let kv = self.pop_mark()?;
                if !kv.len().is_multiple_of(2) {
                    return self.fail("DICT with a key and no value");
                }
                self.push(Node::Dict(kv.chunks(2).map(|p| (p[0], p[1])).collect()));
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                self.set_items(vec![k, v])?;
            }
            b'u' => {
                let kv = self.pop_mark()?;
                self.set_items(kv)?;
            }
            _ => return self.fail(format!("opcode 0x{op:02x} outside its group")),
        }
        Ok(())
    }

    /// Globals, and the objects made of them (nothing is called).
    fn object(&mut self, op: u8) -> Result<(), PickleError> {
        match op {
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                self.global(module, name)?;
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                let (module, name) = (self.str_of(module)?, self.str_of(name)?);
                self.global(module, name)?;
            }
            b'R' | 0x81 => {
                let what = if op == b'R' { "REDUCE" } else { "NEWOBJ" };
                let args = self.pop()?;
                let class = self.pop()?;
                let (class, args) = (self.class_of(class, what)?, self.tuple_items(args, what)?);
                let by = if op == b'R' { Construct::Call } else { Construct::New };
                self.call(class, by, args);
            }
            0x92 => {
                let kwargs = self.pop()?;
                let args = self.pop()?;
                let class = self.pop()?;
                if !matches!(&self.nodes[kwargs], Node::Dict(kv) if kv.is_empty()) {
                    return self.fail("NEWOBJ_EX with keyword arguments");
                }
                let (class, args) = (self.class_of(class, "NEWOBJ_EX")?, self.tuple_items(args, "NEWOBJ_EX")?);
                self.call(class, Construct::New, args);
            }
            b'b' => self.build()?,
            b'Q' => {
                let pid = self.pop()?;
                self.push(Node::PersistentId(pid));
            }
            _ => return self.fail(format!("opcode 0x{op:02x} outside its group")),
        }
        Ok(())
    }

    /// The memo: values stored and fetched by key.
    fn memo_op(&mut self, op: u8) -> Result<(), PickleError> {
        match op {
            b'q' => {
                let k = self.le(1)? as u32;
                self.memo_put(k)?;
            }
            b'r' => {
                let k = self.le(4)? as u32;
                self.memo_put(k)?;
            }
            0x94 => {
                let k = u32::try_from(self.memo.len()).or_else(|_| self.fail("too many memo entries"))?;
                self.memo_put(k)?;
            }
            b'h' => {
                let k = self.le(1)? as u32;
                self.memo_get(k)?;
            }
            b'j' => {
                let k = self.le(4)? as u32;
                self.memo_get(k)?;
            }
            _ => return self.fail(format!("opcode 0x{op:02x} outside its group")),
        }
        Ok(())
    }
    /// The tree of `id`, counting every node it unfolds against `budget`; `path` holds
    /// the containers being unfolded (a pickle that contains itself is refused).
    fn unfold(&self, id: Id, budget: &mut Budget, path: &mut Vec<Id>) -> Result<Value, PickleError> {
        let bytes = match &self.nodes[id] {
            Node::Scalar(Value::Str(s)) => s.len(),
            Node::Scalar(Value::Bytes(b)) => b.len(),
            _ => 0,
        };
        if !budget.spend(bytes) {
            return self.fail("the pickle unfolds into more than its size allows (a memo bomb?)");
        }
        if path.contains(&id) {
            return self.fail("the pickle contains itself");
        }
        if path.len() >= MAX_DEPTH {
            return self.fail(format!("values nested more than {MAX_DEPTH} deep"));
        }
        path.push(id);
        let many = |ids: &[Id], budget: &mut Budget, path: &mut Vec<Id>| -> Result<Vec<Value>, PickleError> {
            ids.iter().map(|&i| self.unfold(i, budget, path)).collect()
        };
        let v = match &self.nodes[id] {
            Node::Scalar(v) => v.clone(),
            Node::Tuple(items) => Value::Tuple(many(items, budget, path)?),
            Node::List(items) => Value::List(many(items, budget, path)?),
            Node::Dict(kv) => Value::Dict(
                kv.iter()
                    .map(|&(k, v)| Ok((self.unfold(k, budget, path)?, self.unfold(v, budget, path)?)))
                    .collect::<Result<_, PickleError>>()?,
            ),
            Node::Object { class, by, args, state } => Value::Object {
                class: class.clone(),
                by: *by,
                args: many(args, budget, path)?,
                state: match state {
                    Some(s) => Some(Box::new(self.unfold(*s, budget, path)?)),
                    None => None,
                },
            },
            Node::PersistentId(p) => Value::PersistentId(Box::new(self.unfold(*p, budget, path)?)),
        };
        path.pop();
        Ok(v)
    }
}
