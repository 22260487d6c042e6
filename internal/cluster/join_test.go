package cluster

import (
	"errors"
	"testing"
)

func TestJoinDistinct(t *testing.T) {
	a, b := errors.New("redis-server not found"), errors.New("port in use")
	err := joinDistinct([]error{a, nil, errors.New("redis-server not found"), b, a})
	if got, want := err.Error(), "redis-server not found\nport in use"; got != want {
		t.Errorf("joinDistinct = %q; want %q", got, want)
	}
	if !errors.Is(err, a) || !errors.Is(err, b) {
		t.Errorf("joinDistinct = %v; want it to match both errors", err)
	}
	if joinDistinct([]error{nil, nil}) != nil {
		t.Error("joinDistinct of nils is not nil")
	}
}
