//! `gasloc-node`: the volunteer's command-line entry point.

fn main() {
    println!("gasloc-node");
}
