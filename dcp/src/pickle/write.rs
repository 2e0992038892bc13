//! Writing a pickle of plain data ([`Value`]) in the binary protocol torch.save writes
//! (2; 3 where the value holds bytes, which protocol 2 cannot hold as such). Nothing is
//! memoised: a value referenced twice is written twice.

use super::value::{Construct, Value};

/// The pickle of `v`.
pub fn write(v: &Value) -> Vec<u8> {
    let mut out = vec![0x80, if holds_bytes(v) { 3 } else { 2 }];
    put(&mut out, v);
    out.push(b'.');
    out
}

fn holds_bytes(v: &Value) -> bool {
    match v {
        Value::Bytes(_) => true,
        Value::Tuple(items) | Value::List(items) => items.iter().any(holds_bytes),
        Value::Dict(kv) => kv.iter().any(|(k, v)| holds_bytes(k) || holds_bytes(v)),
        Value::Object { args, state, .. } => args.iter().any(holds_bytes) || state.as_deref().is_some_and(holds_bytes),
        Value::PersistentId(p) => holds_bytes(p),
        _ => false,
    }
}

fn put(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::None => out.push(b'N'),
        Value::Bool(b) => out.push(if *b { 0x88 } else { 0x89 }),
        Value::Int(i) => put_int(out, *i),
        Value::Float(f) => {
            out.push(b'G');
            out.extend_from_slice(&f.to_be_bytes());
        }
        Value::Str(s) => {
            out.push(b'X');
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        Value::Bytes(b) => {
            out.push(b'B');
            out.extend_from_slice(&(b.len() as u32).to_le_bytes());
            out.extend_from_slice(b);
        }
        Value::Tuple(items) => put_tuple(out, items),
        Value::List(items) => {
            out.push(b']');
            if !items.is_empty() {
                out.push(b'(');
                items.iter().for_each(|i| put(out, i));
                out.push(b'e');
            }
        }
        Value::Dict(kv) => {
            out.push(b'}');
            if !kv.is_empty() {
                out.push(b'(');
                for (k, v) in kv {
                    put(out, k);
                    put(out, v);
                }
                out.push(b'u');
            }
        }
        Value::Global(g) => {
            out.push(b'c');
            for part in [&g.module, &g.name] {
                out.extend_from_slice(part.as_bytes());
                out.push(b'\n');
            }
        }
        Value::Object { class, by, args, state } => {
            put(out, &Value::Global(class.clone()));
            put_tuple(out, args);
            out.push(match by {
                Construct::Call => b'R',
                Construct::New => 0x81,
            });
            if let Some(s) = state {
                put(out, s);
                out.push(b'b');
            }
        }
        Value::PersistentId(p) => {
            put(out, p);
            out.push(b'Q');
        }
    }
}

fn put_tuple(out: &mut Vec<u8>, items: &[Value]) {
    match items.len() {
        0 => out.push(b')'),
        n @ 1..=3 => {
            items.iter().for_each(|i| put(out, i));
            out.push(0x84 + n as u8);
        }
        _ => {
            out.push(b'(');
            items.iter().for_each(|i| put(out, i));
            out.push(b't');
        }
    }
}

fn put_int(out: &mut Vec<u8>, i: i64) {
    match i {
        0..=0xff => out.extend_from_slice(&[b'K', i as u8]),
        0x100..=0xffff => {
            out.push(b'M');
            out.extend_from_slice(&(i as u16).to_le_bytes());
        }
        _ if i32::try_from(i).is_ok() => {
            out.push(b'J');
            out.extend_from_slice(&(i as i32).to_le_bytes());
        }
        _ => {
            // LONG1: the fewest little-endian two's-complement bytes that hold it.
            let bytes = i.to_le_bytes();
            let mut n = 8;
            while n > 1 {
                let (last, below) = (bytes[n - 1], bytes[n - 2]);
                let redundant = (last == 0 && below & 0x80 == 0) || (last == 0xff && below & 0x80 != 0);
                if !redundant {
                    break;
                }
                n -= 1;
            }
            out.extend_from_slice(&[0x8a, n as u8]);
            out.extend_from_slice(&bytes[..n]);
        }
    }
}
