package model

import "fmt"

// TensorSpec is one tensor a checkpoint of a Config must hold.
type TensorSpec struct {
	Name  string
	Shape []int
	// Norm marks RMSNorm weights (initialized to one, no weight decay).
	Norm bool
	// Bias marks bias vectors (initialized to zero, no weight decay).
	Bias bool
}

// Tensors lists the tensors of a checkpoint of c, with HF names and shapes,
// in a stable order (embedding, layers, final norm, head).
func (c *Config) Tensors() []TensorSpec {
	h, q, kv := c.Hidden, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	ts := []TensorSpec{{Name: "model.embed_tokens.weight", Shape: []int{c.VocabSize, h}}}
	for i := 0; i < c.Layers; i++ {
		p := fmt.Sprintf("model.layers.%d.", i)
		ts = append(ts,
			TensorSpec{Name: p + "input_layernorm.weight", Shape: []int{h}, Norm: true},
			TensorSpec{Name: p + "self_attn.q_proj.weight", Shape: []int{q, h}},
			TensorSpec{Name: p + "self_attn.k_proj.weight", Shape: []int{kv, h}},
			TensorSpec{Name: p + "self_attn.v_proj.weight", Shape: []int{kv, h}},
		)
		if c.AttentionBias {
			ts = append(ts,
				TensorSpec{Name: p + "self_attn.q_proj.bias", Shape: []int{q}, Bias: true},
				TensorSpec{Name: p + "self_attn.k_proj.bias", Shape: []int{kv}, Bias: true},
				TensorSpec{Name: p + "self_attn.v_proj.bias", Shape: []int{kv}, Bias: true},
			)
		}
		ts = append(ts, TensorSpec{Name: p + "self_attn.o_proj.weight", Shape: []int{h, q}})
		if c.Arch != ArchQwen2 && c.AttentionBias {
			// Llama and Qwen3 put attention_bias on o_proj too; Qwen2 has
			// q/k/v biases only.
			ts = append(ts, TensorSpec{Name: p + "self_attn.o_proj.bias", Shape: []int{h}, Bias: true})
		}
		if c.QKNorm {
			ts = append(ts,
				TensorSpec{Name: p + "self_attn.q_norm.weight", Shape: []int{c.HeadDim}, Norm: true},
				TensorSpec{Name: p + "self_attn.k_norm.weight", Shape: []int{c.HeadDim}, Norm: true},
			)
		}
		ts = append(ts, TensorSpec{Name: p + "post_attention_layernorm.weight", Shape: []int{h}, Norm: true})
		if c.IsMoE(i) {
			ts = append(ts, TensorSpec{Name: p + "mlp.gate.weight", Shape: []int{c.NumExperts, h}})
			for e := 0; e < c.NumExperts; e++ {
				ep := fmt.Sprintf("%smlp.experts.%d.", p, e)
				ts = append(ts,
					TensorSpec{Name: ep + "gate_proj.weight", Shape: []int{c.MoEIntermediate, h}},
					TensorSpec{Name: ep + "up_proj.weight", Shape: []int{c.MoEIntermediate, h}},
					TensorSpec{Name: ep + "down_proj.weight", Shape: []int{h, c.MoEIntermediate}},
				)
			}
		} else {
			ts = append(ts,
				TensorSpec{Name: p + "mlp.gate_proj.weight", Shape: []int{c.Intermediate, h}},
				TensorSpec{Name: p + "mlp.up_proj.weight", Shape: []int{c.Intermediate, h}},
				TensorSpec{Name: p + "mlp.down_proj.weight", Shape: []int{h, c.Intermediate}},
			)
		}
	}
	ts = append(ts, TensorSpec{Name: "model.norm.weight", Shape: []int{h}, Norm: true})
	if !c.TieEmbeddings {
		ts = append(ts, TensorSpec{Name: "lm_head.weight", Shape: []int{c.VocabSize, h}})
	}
	return ts
}
