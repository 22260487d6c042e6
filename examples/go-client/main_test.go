package main

import (
	"testing"

	"github.com/redfence/redfence/client/clienttest"
)

func TestRun(t *testing.T) {
	t.Parallel()
	s := clienttest.Start(t, clienttest.Options{})
	for range 2 { // the lock is released after each run
		if err := run(t.Context(), s.URL, ""); err != nil {
			t.Fatalf("run = %v", err)
		}
	}
}
