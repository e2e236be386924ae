use attn_serve::gguf::Gguf;
use attn_serve::tokenizer::Tokenizer;

fn main() {
    let g = Gguf::open(std::path::Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    for arg in std::env::args().skip(1) {
        println!("{:?}", tok.encode(&arg));
    }
}
