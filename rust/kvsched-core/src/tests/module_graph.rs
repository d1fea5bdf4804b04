//! The core's modules depend on each other without cycles, checked from the source.
//!
//! A node is a module declared in `lib.rs` (a file `src/<name>.rs`); `lib.rs` itself and the test modules are
//! not nodes. Module `a` depends on module `b` (an edge) when `a`'s source, outside comments, string literals
//! and `#[cfg(test)] mod ... { ... }` blocks:
//! - names a path `crate::b...` or `super::b...` (in a `use`, grouped as `crate::{b, ...}`, or inline);
//! - names `crate::N` where `lib.rs` re-exports `N` from `b` (`pub use b::N;`), since that is `b`'s item;
//! - holds an `impl ... Scheduler` block (for `b` = `scheduler`): it adds methods to the scheduler's type,
//!   reads its fields, and cannot be compiled or understood without `scheduler.rs`.
//!
//! Method calls are not edges: `scheduler.rs` calling a method that `step.rs` defines on `Scheduler` goes
//! through the type, and one type's `impl` blocks spread over several files are one type's methods. What the
//! rule forbids is a module that both holds a type the scheduler stores and adds to the scheduler (the cure:
//! the type in `x.rs`, the `impl Scheduler` block in `x_sched.rs`, as `encoder.rs` / `encoder_sched.rs` do).
//! A name the scanner cannot resolve to a module fails the test, so the scanner cannot silently miss an edge.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Graph = BTreeMap<String, BTreeSet<String>>;

/// `text` with comments and the contents of string and char literals replaced by spaces (lines kept).
fn strip_comments_and_literals(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |ch: char| if ch == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < c.len() {
        let next = c.get(i + 1).copied();
        if c[i] == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c[i] == '/' && next == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(c[i]));
                    i += 1;
                }
            }
        } else if c[i] == '"' {
            out.push('"');
            i += 1;
            while i < c.len() && c[i] != '"' {
                let n = if c[i] == '\\' { 2 } else { 1 };
                out.extend(c[i..(i + n).min(c.len())].iter().map(|&ch| blank(ch)));
                i += n;
            }
            out.push('"');
            i += 1;
        } else if c[i] == '\'' && (next == Some('\\') || c.get(i + 2) == Some(&'\'')) {
            // A char literal ('x', '\n', '\''); a lifetime ('a) has no closing quote after one character.
            let end = (i + 2..c.len()).find(|&k| c[k] == '\'' && (k > i + 2 || next != Some('\\')));
            let end = end.unwrap_or(c.len() - 1);
            out.push_str(&" ".repeat(end + 1 - i));
            i = end + 1;
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

fn is_ident(ch: char) -> bool {
    ch.is_ascii_alphanumeric() || ch == '_'
}

fn ident_at(c: &[char], mut i: usize) -> (String, usize) {
    while i < c.len() && c[i].is_whitespace() {
        i += 1;
    }
    let start = i;
    while i < c.len() && is_ident(c[i]) {
        i += 1;
    }
    (c[start..i].iter().collect(), i)
}

/// Whether the word `w` starts at `i` as a whole word.
fn word_at(c: &[char], i: usize, w: &str) -> bool {
    let n = w.chars().count();
    i + n <= c.len()
        && c[i..i + n].iter().copied().eq(w.chars())
        && (i == 0 || !is_ident(c[i - 1]))
        && c.get(i + n).is_none_or(|&ch| !is_ident(ch))
}

/// Index of the brace that closes the one opened at `open`.
fn matching_brace(c: &[char], open: usize) -> usize {
    let mut depth = 0;
    for (k, &ch) in c.iter().enumerate().skip(open) {
        match ch {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    c.len()
}

/// `code` (already stripped) without its `#[cfg(test)] mod name { ... }` blocks.
fn without_test_modules(code: &str) -> String {
    let mut c: Vec<char> = code.chars().collect();
    let attr: Vec<char> = "#[cfg(test)]".chars().collect();
    let mut i = 0;
    while i + attr.len() <= c.len() {
        if c[i..i + attr.len()] != attr[..] {
            i += 1;
            continue;
        }
        let (mut word, mut j) = ident_at(&c, i + attr.len());
        if word == "pub" {
            (word, j) = ident_at(&c, j);
        }
        if word == "mod" {
            let (_, after_name) = ident_at(&c, j);
            let open = (after_name..c.len()).find(|&k| !c[k].is_whitespace());
            if let Some(open) = open.filter(|&k| c[k] == '{') {
                let end = matching_brace(&c, open).min(c.len() - 1);
                for ch in &mut c[i..=end] {
                    if *ch != '\n' {
                        *ch = ' ';
                    }
                }
            }
        }
        i += attr.len();
    }
    c.into_iter().collect()
}

/// The first path segment after each `crate::` or `super::` in `code`: `crate::{a, b::c}` gives `a` and `b`.
fn path_roots(code: &str) -> Vec<String> {
    let c: Vec<char> = code.chars().collect();
    let mut roots = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let prefix = ["crate", "super"].into_iter().find(|w| word_at(&c, i, w));
        let Some(prefix) = prefix else {
            i += 1;
            continue;
        };
        let mut j = i + prefix.len();
        if !(c.get(j) == Some(&':') && c.get(j + 1) == Some(&':')) {
            i = j;
            continue;
        }
        j += 2;
        if c.get(j) == Some(&'{') {
            let close = matching_brace(&c, j);
            let mut depth = 0;
            let mut expect_item = true;
            for k in j..close {
                match c[k] {
                    '{' => {
                        depth += 1;
                        expect_item = depth == 1;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 1 => expect_item = true,
                    ch if depth == 1 && expect_item && is_ident(ch) => {
                        let (name, _) = ident_at(&c, k);
                        roots.push(name);
                        expect_item = false;
                    }
                    _ => {}
                }
            }
            i = close;
        } else {
            let (name, end) = ident_at(&c, j);
            roots.push(name);
            i = end;
        }
    }
    roots
}

/// Whether `code` holds an `impl` block whose self type is `Scheduler` (`impl Scheduler`, `impl<..> X for
/// Scheduler`).
fn implements_scheduler(code: &str) -> bool {
    let c: Vec<char> = code.chars().collect();
    (0..c.len()).filter(|&i| word_at(&c, i, "impl")).any(|i| {
        let header: String = c[i + 4..].iter().take_while(|&&ch| ch != '{' && ch != ';').collect();
        // Unbalanced parentheses: `impl Trait` in a function's parameter list, not an impl block.
        if header.matches('(').count() != header.matches(')').count() {
            return false;
        }
        let header = header.split(" where ").next().unwrap_or("");
        let self_type = match header.rsplit_once(" for ") {
            Some((_, ty)) => ty,
            // Generics first: `impl<T: A> Type` (the self type is what follows the closing `>`).
            None => header.rsplit_once('>').map_or(header, |(_, ty)| ty),
        };
        self_type.trim() == "Scheduler"
    })
}

/// What `lib.rs` declares: its modules (not `#[cfg(test)]` ones) and the names it re-exports, by module.
fn crate_root(lib: &str) -> (BTreeSet<String>, BTreeMap<String, String>) {
    let code = strip_comments_and_literals(lib);
    let mut modules = BTreeSet::new();
    let mut exports = BTreeMap::new();
    for stmt in code.split(';') {
        let stmt = stmt.trim();
        let (attrs, item) = match stmt.rfind(']') {
            Some(k) if stmt.starts_with('#') => (&stmt[..=k], stmt[k + 1..].trim()),
            _ => ("", stmt),
        };
        let test_only = attrs.contains("cfg(test)");
        let item = item.strip_prefix("pub ").unwrap_or(item);
        if let Some(name) = item.strip_prefix("mod ") {
            if !test_only {
                modules.insert(name.trim().to_string());
            }
        } else if let Some(path) = item.strip_prefix("use ") {
            let (module, names) = path.split_once("::").unwrap_or((path, ""));
            let names = names.trim_start_matches('{').trim_end_matches('}');
            for name in names.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                exports.insert(name.to_string(), module.trim().to_string());
            }
        }
    }
    (modules, exports)
}

/// The modules `source` (the text of module `name`) depends on, by the rules in this file's header. Panics on
/// a `crate::` or `super::` path it cannot resolve to a module.
fn dependencies(
    name: &str,
    source: &str,
    modules: &BTreeSet<String>,
    exports: &BTreeMap<String, String>,
) -> BTreeSet<String> {
    let code = without_test_modules(&strip_comments_and_literals(source));
    let mut deps = BTreeSet::new();
    for root in path_roots(&code) {
        let module = if modules.contains(&root) {
            root
        } else if let Some(m) = exports.get(&root) {
            m.clone()
        } else {
            panic!("{name}.rs: cannot resolve `crate::{root}` (or `super::{root}`) to a module");
        };
        deps.insert(module);
    }
    if implements_scheduler(&code) {
        deps.insert("scheduler".into());
    }
    deps.remove(name);
    deps
}

/// A cycle of `graph` (its first node repeated at the end), or `None`.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &Graph,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(node.to_string(), 1);
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            match state.get(next) {
                Some(1) => {
                    let start = path.iter().position(|n| n == next).unwrap_or(0);
                    let mut cycle = path[start..].to_vec();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                Some(_) => {}
                None => {
                    if let Some(cycle) = visit(next, graph, state, path) {
                        return Some(cycle);
                    }
                }
            }
        }
        path.pop();
        state.insert(node.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in graph.keys() {
        if !state.contains_key(node) {
            if let Some(cycle) = visit(node, graph, &mut state, &mut Vec::new()) {
                return Some(cycle);
            }
        }
    }
    None
}

fn core_graph() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let read = |file: &str| std::fs::read_to_string(src.join(file)).unwrap();
    let (modules, exports) = crate_root(&read("lib.rs"));
    let files: BTreeSet<String> = std::fs::read_dir(&src)
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().into_string().ok())
        .filter_map(|f| f.strip_suffix(".rs").map(str::to_string))
        .filter(|f| f != "lib")
        .collect();
    assert_eq!(files, modules, "every src/*.rs file is a module lib.rs declares, and the other way round");
    modules
        .iter()
        .map(|m| (m.clone(), dependencies(m, &read(&format!("{m}.rs")), &modules, &exports)))
        .collect()
}

#[test]
fn the_scanner_counts_every_form_of_a_dependency() {
    let modules: BTreeSet<String> =
        ["a", "b", "c", "d", "e", "f", "g", "scheduler", "t"].into_iter().map(String::from).collect();
    let exports = BTreeMap::from([("Thing".to_string(), "g".to_string())]);
    let source = r#"
//! Docs naming crate::t are not an edge.
use crate::a::X;
use crate::{
    b::{Y, Z},
    c,
};
fn f(x: &crate::Thing) -> u32 {
    let s = "crate::t::not_code"; // crate::t neither
    let q = '"';
    crate::d::helper(super::e::CONST, s, q)
}
impl<'a> std::fmt::Debug for Scheduler where Self: 'a {}
#[cfg(test)]
mod tests {
    use crate::t::only_in_tests;
}
"#;
    let deps = dependencies("f", source, &modules, &exports);
    let want: BTreeSet<String> =
        ["a", "b", "c", "d", "e", "g", "scheduler"].into_iter().map(String::from).collect();
    assert_eq!(deps, want);
    // An inherent impl counts too; the module's own name is never an edge.
    assert!(implements_scheduler("impl Scheduler {\n}"));
    assert!(!implements_scheduler("impl SchedulerOutput {}\nimpl Foo for Bar {}"));
    assert!(!implements_scheduler("fn new(f: impl Fn(u32) -> u32) -> Scheduler {}"));
    assert!(dependencies("scheduler", "impl Scheduler {}", &modules, &exports).is_empty());
    // The root's modules and re-exports.
    let (m, e) = crate_root("mod a;\npub mod b;\n#[cfg(test)]\nmod t;\npub use a::{X, Y};\npub use b::Z;\n");
    assert_eq!(m, ["a", "b"].into_iter().map(String::from).collect());
    assert_eq!((e["X"].as_str(), e["Y"].as_str(), e["Z"].as_str()), ("a", "a", "b"));
}

#[test]
#[should_panic(expected = "cannot resolve `crate::nowhere`")]
fn the_scanner_refuses_a_path_it_cannot_resolve() {
    dependencies("a", "use crate::nowhere::X;", &BTreeSet::new(), &BTreeMap::new());
}

#[test]
fn find_cycle_finds_one() {
    let graph = |edges: &[(&str, &str)]| {
        let mut g = Graph::new();
        for &(a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    let cycle = find_cycle(&graph(&[("a", "b"), ("b", "c"), ("c", "a")])).unwrap();
    assert_eq!(cycle, ["a", "b", "c", "a"]);
    assert_eq!(find_cycle(&graph(&[("a", "b"), ("c", "a"), ("c", "b")])), None);
}

#[test]
fn the_core_modules_depend_on_each_other_without_cycles() {
    let graph = core_graph();
    assert_eq!(find_cycle(&graph), None);
    // The scanner sees the edges it must see (so an empty graph cannot pass).
    let has = |a: &str, b: &str| graph[a].contains(b);
    assert!(has("step", "scheduler") && has("scheduler", "swap") && has("scheduler", "connector"));
    assert!(has("swap_sched", "scheduler") && has("swap_sched", "swap") && has("step", "swap_sched"));
    assert!(has("update", "scheduler") && has("introspect", "scheduler"));
}
